"""``ulysses-sp bench`` smoke test: tiny settings, real processes, the JSON records checked.

Timings are not asserted (speed goals live in benchmarks/); what is asserted is what must hold
on any machine: every system computes the same first-step loss as one process, the bytes our
Ulysses layer puts on the wire equal the hand-derived count, and it issues 2 collectives per
attention layer in forward and backward.
"""

import importlib.util
import json

import pytest

from ulysses_sp.cli.main import main

TINY = ["--seq-lens", "32", "--sp-sizes", "2", "--layers", "2", "--hidden", "32", "--intermediate", "48",
        "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--vocab", "64", "--warmup", "1", "--repeats", "1",
        "--device", "cpu"]
FIELDS = {"system", "sp_size", "seq_len", "median_step_seconds", "peak_memory_bytes", "bytes_sent_per_rank",
          "collectives_per_layer", "loss", "machine", "formula", "formula_bytes_sent_per_rank"}

# Ulysses, N=4 K=2 P=2 H=8 B=1 s=16 fp32, per layer, rank 0 (holds q heads 0-1 and kv head 0):
# forward to rank 1: q heads 2,3 + k,v head 1 of my 16 tokens = (2 + 1 + 1) * 16 * 8 = 512 elements,
# plus my heads' output for rank 1's tokens = 2 * 16 * 8 = 256; backward sends the same amounts.
ULYSSES_BYTES_PER_LAYER = 2 * (512 + 256) * 4
# Ring: a k|v block is 2 tensors * K=2 heads * 16 tokens * 8 dims fp32 = 2048 B; forward 1 hop (P-1),
# backward 1 k|v hop + 2 (P) fp32 dk|dv hops.
RING_BYTES_PER_LAYER = 2048 + 2048 + 2 * 2048


def _run(tmp_path, systems, mode):
    out = tmp_path / "bench.json"
    code = main(["bench", *TINY, "--systems", *systems, "--mode", mode, "--json", str(out),
                 "--markdown", str(tmp_path / "b.md"), "--plots", str(tmp_path / "plots")])
    records = json.loads(out.read_text())
    paired = {r["system"]: r for r in records if r.get("mode") == "paired"}
    return code, {r["system"]: r for r in records if r.get("mode") != "paired"}, paired


def test_bench_smoke_records(tmp_path):
    """Catches missing JSON fields, a system that trains on a different loss than one process
    (wrong sharding / loss scaling), a byte counter or exchange that sends more or less than the
    Ulysses layout needs, and a third collective per layer sneaking into the attention."""
    code, records, paired = _run(tmp_path, ["single", "ulysses", "ring"], "both")
    assert code == 0
    assert set(records) == {"single", "ulysses", "ring"} and set(paired) == {"ulysses", "ring"}
    for r in paired.values():  # alternating steps in one process group: same first-step loss
        assert r["loss"] == pytest.approx(records["single"]["loss"], rel=1e-5) and len(r["step_seconds"]) == 1
    for r in records.values():
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["median_step_seconds"] > 0 and r["peak_memory_bytes"] >= 0
        # fp32, same weights and batch; only summation order differs across shardings: 1e-5 relative
        assert r["loss"] == pytest.approx(records["single"]["loss"], rel=1e-5)
    ours, ring = records["ulysses"], records["ring"]
    assert ours["bytes_sent_per_rank"] == ULYSSES_BYTES_PER_LAYER == ours["formula_bytes_sent_per_rank"]
    assert ours["collectives_per_layer"] == 2 and ours["collectives_per_layer_backward"] == 2
    assert ring["bytes_sent_per_rank"] == RING_BYTES_PER_LAYER
    assert ring["collectives_per_layer"] == 1 and ring["collectives_per_layer_backward"] == 3
    assert (tmp_path / "plots" / "step_time.png").stat().st_size > 0
    assert "| 32 | 2 | ulysses |" in (tmp_path / "b.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_bench_deepspeed_same_loss_and_its_collectives(tmp_path):
    """Catches a DeepSpeed wiring that differs from HF/ALST (loss not equal to ours) and a
    counter that misses DeepSpeed's traffic: 3 + 1 all-to-alls and the position_ids all-gather."""
    code, records, _ = _run(tmp_path, ["ulysses", "deepspeed"], "isolated")
    assert code == 0
    ds = records["deepspeed"]
    assert ds["loss"] == pytest.approx(records["ulysses"]["loss"], rel=1e-5)  # fp32 reordering only
    assert ds["collectives_per_layer"] == 5 and ds["collectives_per_layer_backward"] == 4
    # q (4 heads), k, v (2 heads each), out (4 heads): 12 * 16 * 8 fp32 elements, half to the peer,
    # both directions; + 16 int64 positions to the peer in forward
    assert ds["bytes_sent_per_rank"] == 2 * (12 * 16 * 8 * 4 // 2) + 16 * 8
