"""RoPE variants that pick their frequencies from the sequence length (LongRoPE, dynamic NTK).

They read ``max(position_ids) + 1`` of the call; under SP each rank would see only its shard's
positions. Reference: ONE plain-transformers call on the global batch (packed rows included, their
documents kept apart by a 4-D mask: the rotary sees the row's largest position, as in padding-free
training), loss and every gradient; the sequences are longer than the models' original lengths
(16), so the first shard stays below the threshold while the batch crosses it.
"""

import pytest
import torch
import torch.distributed as dist

from dist_helper import spawn
from reference import reference_step
from test_hf_parity import sp_run
from tiny_models import tiny_batch, tiny_model
from ulysses_sp import SPMesh
from ulysses_sp.attention import document_ids_from_position_ids
from ulysses_sp.integrations.rope import length_dependent_rope

FAMILIES = ("phi3_longrope", "llama_dynamic")


def reference(family, kind):
    model = tiny_model(family)
    batch = tiny_batch(kind)
    labels = batch.get("labels", batch["input_ids"])
    if "position_ids" in batch:  # packed: documents kept apart by a 4-D mask in the same single call
        doc = document_ids_from_position_ids(batch["position_ids"])
        S = doc.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        batch["attention_mask"] = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]
    return reference_step(model, {k: v for k, v in batch.items() if k != "labels"}, labels)


def _worker(rank, world, plan):
    mesh = SPMesh.from_world(world)
    for family, kind in plan:
        ref_loss, ref_grads = reference(family, kind)
        loss, grads = sp_run(family, kind, mesh)
        where = f"{family}/{kind}/P={world}"
        # fp32, summation order only (as test_hf_parity.check); the shard-length frequencies were 3e-2 off
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} loss: {m}")
        for name, ref in ref_grads.items():
            scale = ref.abs().max().clamp_min(1e-8)
            torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=1e-4,
                                       msg=lambda m, name=name: f"{where} grad {name}: {m}")
    dist.barrier()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_length_dependent_rope_sees_the_global_length(world):
    """Bug caught: LongRoPE / dynamic NTK chose their frequencies from each shard's largest position
    (rank 0 below the original length, the last rank above it: a different model on each rank, and
    the positions that pad S to a multiple of P pushed the last rank past the batch's length)."""
    kinds = {2: ("plain", "odd"), 3: ("packed_long", "padding"), 4: ("padding", "packed_long")}[world]
    spawn(_worker, world, [(f, k) for f in FAMILIES for k in kinds])


def test_only_length_dependent_rotary_modules_are_hooked():
    """Bug caught: the hooks landing on rotary embeddings whose frequencies do not depend on the length."""
    hooked = {f: [type(m).__name__ for m in tiny_model(f).modules() if length_dependent_rope(m)]
              for f in ("phi3_longrope", "llama_dynamic", "llama", "gemma3")}
    assert hooked == {"phi3_longrope": ["Phi3RotaryEmbedding"], "llama_dynamic": ["LlamaRotaryEmbedding"],
                      "llama": [], "gemma3": []}


def test_check_reference_feeds_packed_documents_the_batch_length(tmp_path):
    """Bug caught: ``ulysses-sp check --packed`` ran each reference document alone, so a LongRoPE
    model's reference picked frequencies from each document's length while training (one call on
    the packed row, and SP) uses the row's largest position: a false MISMATCH."""
    from ulysses_sp.cli.check.engine import CheckOptions, run_check

    config, _ = __import__("tiny_models").tiny_config("phi3_longrope")
    config.save_pretrained(tmp_path)
    report = run_check(CheckOptions(model=str(tmp_path / "config.json"), sp_size=2, seq_len=48, packed=True,
                                    random_init=True))
    assert report.comparison.ok, report.comparison
