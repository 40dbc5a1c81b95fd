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
# backward 1 k|v hop + 2 (P) fp32 dk|dv hops. Causal load balance (zigzag, 4 chunks of 8 tokens): rank 0
# keeps chunk 0, sends chunk 1 of q|k|v to rank 1 (8 tokens * (4 + 2*2) heads * 8 dims = 512 el = 2048 B)
# and receives chunk 3; after the ring it sends chunk 3's output back (8*4*8 = 256 el = 1024 B). The
# backward moves the same amounts the other way: + 2 * (2048 + 1024), and 2 + 2 more P2P batches.
RING_BYTES_PER_LAYER = 2048 + 2048 + 2 * 2048 + 2 * (2048 + 1024)


def _run(tmp_path, systems, mode):
    out = tmp_path / "bench.json"
    code = main(["bench", *TINY, "--systems", *systems, "--mode", mode, "--json", str(out),
                 "--markdown", str(tmp_path / "b.md"), "--plots", str(tmp_path / "plots")])
    records = json.loads(out.read_text())
    paired = {r["system"]: r for r in records if r.get("mode") == "paired"}
    return code, {r["system"]: r for r in records if r.get("mode") != "paired"}, paired


def test_bench_smoke_records(tmp_path):
    """Bug caught: missing JSON fields, a system that trains on a different loss than one process
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
    assert ring["collectives_per_layer"] == 1 + 2 and ring["collectives_per_layer_backward"] == 3 + 2
    assert (tmp_path / "plots" / "step_time.png").stat().st_size > 0
    assert "| 32 | 2 | ulysses |" in (tmp_path / "b.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_bench_deepspeed_same_loss_and_its_collectives(tmp_path):
    """Bug caught: a DeepSpeed wiring that differs from HF/ALST (loss not equal to ours) and a
    counter that misses DeepSpeed's traffic: 3 + 1 all-to-alls and the position_ids all-gather."""
    code, records, _ = _run(tmp_path, ["ulysses", "deepspeed"], "isolated")
    assert code == 0
    ds = records["deepspeed"]
    assert ds["loss"] == pytest.approx(records["ulysses"]["loss"], rel=1e-5)  # fp32 reordering only
    assert ds["collectives_per_layer"] == 5 and ds["collectives_per_layer_backward"] == 4
    # q (4 heads), k, v (2 heads each), out (4 heads): 12 * 16 * 8 fp32 elements, half to the peer,
    # both directions; + 16 int64 positions to the peer in forward
    assert ds["bytes_sent_per_rank"] == 2 * (12 * 16 * 8 * 4 // 2) + 16 * 8


def test_bench_chunked_system_recompute_bytes_collectives_and_paired_one_process(tmp_path):
    """Bug caught: ``--systems ulysses_chunked`` not reaching UlyssesSPConfig(sp_head_chunks) (it would
    issue 2 collectives per layer), head blocks that send other bytes than their formula or change the
    loss, a backward that does not re-send exactly one q|k|v exchange per block, a formula that does not
    know the blocks, paired runs that lose the one-process steps they are
    compared with (the 'one process / system' ratio on equal cores), and --attention-memory not
    measuring both the unchunked and the chunked layer."""
    out = tmp_path / "bench.json"
    code = main(["bench", *TINY, "--systems", "single", "ulysses", "ulysses_chunked", "--json", str(out),
                 "--markdown", str(tmp_path / "b.md"), "--attention-memory"])
    assert code == 0
    all_records = json.loads(out.read_text())
    records = {r["system"]: r for r in all_records if "mode" not in r}
    paired = {r["system"]: r for r in all_records if r.get("mode") == "paired"}
    memory = [r for r in all_records if r.get("mode") == "attention_memory"]
    assert sorted(r["head_chunks"] for r in memory) == [1, 2] and all(r["peak_attention_bytes"] >= 0 for r in memory)
    ours, chunked = records["ulysses"], records["ulysses_chunked"]
    # N=4 query / K=2 kv heads on P=2 ranks, --sp-head-chunks 2 (default): head blocks of 1 kv and 2 query
    # heads, G=2 -> 2G = 4 forward, 4G = 8 backward (q|k|v, output, output grad, q|k|v grads per block)
    assert chunked["head_chunks"] == 2
    assert chunked["collectives_per_layer"] == 4 and chunked["collectives_per_layer_backward"] == 8
    assert chunked["formula_collectives_per_layer"] == 4
    assert ours["bytes_sent_per_rank"] == ULYSSES_BYTES_PER_LAYER
    # s=16 tokens of H=8, fp32: unchunked forward q 2 heads + k, v 1 head + output 2 heads = 6 x 16 x 8 x 4;
    # a block sends 1 query head, its kv head (read by both ranks: K < P inside the block) and 1 output head,
    # 4 x 16 x 8 x 4 per block; its backward sends its output grad and q|k|v grads, and q|k|v and output again
    assert ours["bytes_sent_per_rank_forward"] == ULYSSES_BYTES_PER_LAYER // 2 == 6 * 16 * 8 * 4
    assert chunked["bytes_sent_per_rank_forward"] == 2 * 4 * 16 * 8 * 4
    assert chunked["bytes_sent_per_rank"] == 2 * (4 + 8) * 16 * 8 * 4
    assert chunked["formula_bytes_sent_per_rank"] == chunked["bytes_sent_per_rank"]
    # fp32, same weights and batch; only summation order differs: 1e-5 relative
    assert chunked["loss"] == pytest.approx(records["single"]["loss"], rel=1e-5)
    for r in paired.values():
        assert len(r["one_process_step_seconds"]) == len(r["step_seconds"]) == 1
        assert r["one_process_loss"] == pytest.approx(r["loss"], rel=1e-5)  # fp32 reordering only
        assert r["one_process_vs_system"] == pytest.approx(r["one_process_step_seconds"][0] / r["step_seconds"][0])
    for r in records.values():
        assert r["tokens_per_second"] == pytest.approx(32 / r["median_step_seconds"])
    text = (tmp_path / "b.md").read_text()
    assert "| 32 | 2 | ulysses_chunked (C=2) |" in text and "one process / system" in text


def test_bench_interrupted_run_keeps_what_it_measured(tmp_path, monkeypatch, capsys):
    """Bug caught: records written only at the end (an interrupted or killed run would leave nothing)
    and rows printed only after the whole run: the second configuration is interrupted, the first
    one's record must be in the JSON file and its row on stdout, and the exit code says 130."""
    from ulysses_sp.cli import bench

    real, calls = bench._run_task, []

    def interrupt_second(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "_run_task", interrupt_second)
    out = tmp_path / "bench.json"
    code = main(["bench", *TINY, "--systems", "single", "ulysses", "--mode", "isolated", "--json", str(out)])
    assert code == 130
    records = json.loads(out.read_text())
    assert [r["system"] for r in records] == ["single"]
    printed = capsys.readouterr().out
    assert "| isolated | 32 | 1 | single |" in printed and "interrupted" in printed


def test_bench_budget_skips_what_would_not_fit():
    """Bug caught: a time budget that lets a long configuration start near the end (the default run
    must finish in 5 minutes) or that refuses work when there is no limit or nothing measured."""
    from types import SimpleNamespace

    from ulysses_sp.cli.bench.report import Budget

    def job(S):
        return [SimpleNamespace(seq_len=S)]
    budget = Budget(30.0)
    assert budget.refuses(job(8192), steps=5) is None  # nothing measured yet: run it
    budget.measured(1024, step_s=1.0, steps=5, wall_s=15.0)  # launch cost 15 - 5 = 10 s
    assert budget.refuses(job(1024), steps=5) is None  # 10 + 5 * 1 s = 15 s < 30 s
    assert budget.refuses(job(4096), steps=5) is not None  # 10 + 5 * 1 s * 4 ** 1.5 = 50 s > 30 s
    assert Budget(0).refuses(job(1 << 20), steps=100) is None


def test_bench_ulysses_ring_system_counts_bytes_of_its_formula(tmp_path):
    """Bug caught: ``--systems ulysses_ring`` not reaching UlyssesSPConfig(sp_ring_size) (a plain
    all-to-all over P=4 ranks would send other bytes), a formula that disagrees with the counted
    bytes / collectives, and a 2-D split whose loss differs from one process."""
    out = tmp_path / "bench.json"
    argv = [*TINY]
    argv[argv.index("--sp-sizes") + 1] = "4"
    code = main(["bench", *argv, "--systems", "single", "ulysses_ring", "--ring-size", "2", "--mode", "isolated",
                 "--json", str(out)])
    assert code == 0
    records = {r["system"]: r for r in json.loads(out.read_text())}
    two_d = records["ulysses_ring"]
    assert two_d["sp_size"] == 4 and two_d["ring_size"] == 2
    # N=4 K=2 over A=2: rank 0 holds q heads 0-1, kv head 0; s=8 tokens, H=8, fp32. All-to-all (P=2 terms
    # on s=8): forward (2+1+1)*8*8 + 2*8*8 = 384 elements, backward the same. Ring over R=2 segments of
    # A*s=16 tokens, k_r=1 kv head: a k|v block is 2*1*16*8 = 256 elements; forward 1 hop, backward 1 hop
    # + 2 fp32 dk|dv hops. Zigzag re-layout of the ring (causal): one q|k|v half (8 tokens * (2 + 2*1) heads
    # * 8 = 256 el) and one output half (8*2*8 = 128 el) move each way: + 2 * (256 + 128) * 4 B, 2 + 2 P2P batches.
    expected = 2 * 384 * 4 + 256 * 4 + (256 * 4 + 2 * 256 * 4) + 2 * (256 + 128) * 4
    assert two_d["bytes_sent_per_rank"] == two_d["formula_bytes_sent_per_rank"] == expected
    assert two_d["collectives_per_layer"] == 2 + 1 + 2 and two_d["collectives_per_layer_backward"] == 2 + 3 + 2
    # fp32, same weights and batch; only summation order differs: 1e-5 relative
    assert two_d["loss"] == pytest.approx(records["single"]["loss"], rel=1e-5)


def test_bench_documents_runs_every_system_on_the_same_packed_batch(tmp_path):
    """Bug caught: ``--documents`` not reaching a system (it would train on one long document: a
    different loss from the packed one process), packed records compared with unpacked ones, and the
    attention time per token missing (or not compared with the one-document row); the paired one
    process under its own registry key getting no mask from transformers (its packed rows attended
    across documents)."""
    out = tmp_path / "bench.json"
    code = main(["bench", *TINY, "--systems", "single", "ulysses", "--mode", "both", "--documents", "1", "4",
                 "--json", str(out), "--markdown", str(tmp_path / "b.md")])
    everything = json.loads(out.read_text())
    records = {(r["system"], r["documents"]): r for r in everything if r.get("mode") != "paired"}
    paired = {r["documents"]: r for r in everything if r.get("mode") == "paired"}
    # the paired one process (own registry key) must see the packed masks too: fp32 reordering only
    for docs in (1, 4):
        assert paired[docs]["one_process_loss"] == pytest.approx(paired[docs]["loss"], rel=1e-5), docs
    assert code == 0 and set(records) == {(s, d) for s in ("single", "ulysses") for d in (1, 4)}
    # attention is timed apart from the step (every system, forward + backward) and reported per token
    for r in records.values():
        assert 0 < r["attention_seconds"] < r["median_step_seconds"], r
        assert r["attention_us_per_token"] == pytest.approx(r["attention_seconds"] / 32 * 1e6)
    text = (tmp_path / "b.md").read_text()
    assert "attention vs 1 document" in text and "| 32 | 2 | ulysses" in text.split("Packed rows")[1]
    # fp32, same weights and packed batch; only summation order differs: 1e-5 relative
    assert records["ulysses", 4]["loss"] == pytest.approx(records["single", 4]["loss"], rel=1e-5)
    # 4 documents: no prediction crosses a boundary and attention stays inside documents
    assert records["single", 4]["loss"] != pytest.approx(records["single", 1]["loss"], rel=1e-5)


def _restore_worker(rank, world):
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ulysses_sp import CommCounter, SPMesh, current_attn_implementation
    from ulysses_sp.cli.bench.systems import ModelSpec, build_model, deepspeed_step, make_batch, ours_step, single_step

    spec = ModelSpec(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8)
    mesh, ids = SPMesh.from_world(world), make_batch(spec, 1, 32, torch.device("cpu"))
    before = dict(ALL_ATTENTION_FUNCTIONS.items())
    builders = {"single": lambda m, c: single_step(m, ids, own_kernel_key=True),
                "ulysses": lambda m, c: ours_step(m, ids, mesh, c, backend="ulysses"),
                "ulysses_chunked": lambda m, c: ours_step(m, ids, mesh, c, backend="ulysses", head_chunks=2),
                "deepspeed": lambda m, c: deepspeed_step(m, ids, mesh, c)}
    for name, build in builders.items():
        model, counter = build_model(spec, 32, torch.device("cpu"), torch.float32), CommCounter()
        step = build(model, counter)
        with counter:
            step.run(counter)
        step.close()
        after = dict(ALL_ATTENTION_FUNCTIONS.items())
        assert after == before, f"{name}: registry entries changed: {set(after.items()) ^ set(before.items())}"
        assert current_attn_implementation(model) == "sdpa", (name, current_attn_implementation(model))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed")
def test_every_bench_system_restores_what_it_registers():
    """Bug caught: a bench system that leaves its attention function in transformers' global registry
    (DeepSpeed's setup overwrote the 'sdpa' entry and never put it back, so every later system in the
    process, and the one-process reference, ran DeepSpeed's attention) or leaves the model on its
    own kernel key after ``Step.close()``."""
    from dist_helper import spawn

    spawn(_restore_worker, 2)
