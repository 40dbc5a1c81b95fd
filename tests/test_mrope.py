"""Vision-language text towers with multimodal rotary positions (MRoPE) under Ulysses SP.

Tiny Qwen2-VL (``(3, B, S)`` positions) and Qwen3-VL (``(4, B, S)``: a text row, then three MRoPE
rows; interleaved sections) models, run on text batches whose image placeholder tokens carry the
genuinely 3-D positions ``get_rope_index`` computes on the FULL batch (temporal / height / width
rows differ on image tokens). Reference: the unmodified model in one process on the global batch
(packed rows: each document on its own, the flash-attention varlen semantics, as in
``test_hf_parity.py``). Image batches with real pixels (``check_images``): the vision tower runs on
every rank, the merged embeddings are sliced before the text tower, and every gradient (vision tower
included) equals one process's.
"""

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from dist_helper import spawn
from reference import reference_step
from ulysses_sp import SPMesh, UlyssesSPConfig
from ulysses_sp.attention import document_ids_from_position_ids
from ulysses_sp.data.sharding import shard_batch
from ulysses_sp.integrations.transformers import UlyssesSP, check_model_support
from ulysses_sp.loss import global_num_items, reported_loss

IMAGE, VIDEO, VISION_START = 120, 121, 122
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # head_dim 16: 8 frequencies
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, tie_word_embeddings=False)


def tiny_vl_config(family: str):
    if family == "qwen2_vl":  # (3, B, S) positions, contiguous sections
        vision = dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, mlp_ratio=1, patch_size=2,
                      spatial_merge_size=1, temporal_patch_size=1)
        return tf.Qwen2VLConfig(text_config={**TEXT, "rope_parameters": MROPE}, vision_config=vision, **TOKENS)
    if family == "qwen2_5_vl":
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64, patch_size=2,
                      spatial_merge_size=1, temporal_patch_size=1, fullatt_block_indexes=[0])
        return tf.Qwen2_5_VLConfig(text_config={**TEXT, "rope_parameters": MROPE}, vision_config=vision, **TOKENS)
    if family == "qwen3_vl":  # (4, B, S) positions (text row first), interleaved sections
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64, patch_size=2,
                      spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16,
                      deepstack_visual_indexes=[])
        text = {**TEXT, "head_dim": 16, "rope_parameters": {**MROPE, "mrope_interleaved": True}}
        return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **TOKENS)
    raise KeyError(family)


def tiny_vl_model(family: str, seed: int = 0, deepstack: bool = False):
    torch.manual_seed(seed)
    config = tiny_vl_config(family)
    if deepstack and family == "qwen3_vl":  # features of vision layer 0 also added in the first text layers
        config.vision_config.deepstack_visual_indexes = [0]
    model = tf.AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # larger than the default init so attention patterns (and positions) matter
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


def _document(gen, num_before, grid, num_after):
    """Token ids and modality types of one document: text, vision_start, image tokens, text."""
    num_image = grid[0] * grid[1] * grid[2]
    ids = torch.cat([torch.randint(3, 100, (num_before,), generator=gen), torch.tensor([VISION_START]),
                     torch.full((num_image,), IMAGE), torch.randint(3, 100, (num_after,), generator=gen)])
    types = torch.zeros_like(ids)
    types[num_before + 1:num_before + 1 + num_image] = 1
    return ids, types


def vl_batch(model, kind: str, seed: int = 1) -> dict:
    """'padding': B=2, S=23 (right, left padding), one image a row; 'packed': B=1, S=23, documents of
    9 (image), 6 (text) and 8 (image) tokens. ``position_ids`` from the model's ``get_rope_index`` on the
    FULL batch (per document when packed); Qwen3-VL: a row of text positions first (4 rows)."""
    gen = torch.Generator().manual_seed(seed)
    rope_index = model.model.get_rope_index
    four_rows = model.config.model_type == "qwen3_vl"
    if kind == "padding":
        (ids0, t0), (ids1, t1) = _document(gen, 4, (1, 2, 3), 7), _document(gen, 5, (1, 3, 2), 8)
        ids = torch.zeros(2, 23, dtype=torch.long)
        types = torch.zeros_like(ids)
        ids[0, :18], types[0, :18] = ids0, t0
        ids[1, 3:], types[1, 3:] = ids1, t1
        am = (torch.arange(23) < 18).long().expand(2, 23).clone()
        am[1] = (torch.arange(23) >= 3).long()
        grids = torch.tensor([[1, 2, 3], [1, 3, 2]])
        pos = rope_index(ids, mm_token_type_ids=types, image_grid_thw=grids, attention_mask=am)[0]
        text = (am.cumsum(-1) - 1).masked_fill(am == 0, 0)  # what transformers' generation uses
        labels = ids.masked_fill((am == 0) | (types == 1), -100)
        labels[1, 3] = -100  # predicted from a padding position: undefined (kernel-dependent) in transformers
        batch = {"input_ids": ids, "attention_mask": am, "labels": labels}
    elif kind == "packed":
        text_doc = torch.randint(3, 100, (6,), generator=gen)
        docs = [_document(gen, 2, (1, 2, 3), 0), (text_doc, torch.zeros_like(text_doc)),
                _document(gen, 1, (1, 2, 2), 2)]
        grids = [torch.tensor([[1, 2, 3]]), None, torch.tensor([[1, 2, 2]])]
        pos = torch.cat([rope_index(d[None], mm_token_type_ids=t[None], image_grid_thw=g)[0] if g is not None
                         else torch.arange(d.numel()).expand(3, 1, -1) for (d, t), g in zip(docs, grids)], dim=-1)
        text = torch.cat([torch.arange(d.numel()) for d, _ in docs])[None]
        ids = torch.cat([d for d, _ in docs])[None]
        types = torch.cat([t for _, t in docs])[None]
        batch = {"input_ids": ids, "labels": ids.masked_fill(types == 1, -100)}
    else:
        raise KeyError(kind)
    assert not torch.equal(pos[0], pos[1]) and not torch.equal(pos[1], pos[2])  # genuinely 3-D positions
    batch["position_ids"] = torch.cat([text[None], pos]) if four_rows else pos
    batch["mm_token_type_ids"] = types  # what a processor returns; dropped by shard_batch (positions are given)
    batch["image_grid_thw"] = grids if kind == "padding" else torch.cat([grids[0], grids[2]])
    return batch


def reference(family, kind):
    model = tiny_vl_model(family)
    batch = vl_batch(model, kind)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    starts = [0, 9, 15, 23] if kind == "packed" else None  # the documents (3-D positions do not restart at 0)
    return reference_step(model, inputs, batch["labels"], starts=starts, sliced=("input_ids", "position_ids"),
                          use_cache=False)


def sp_run(family, kind, mesh):
    model = tiny_vl_model(family)
    batch = vl_batch(model, kind)
    with UlyssesSP(model, mesh, UlyssesSPConfig(sp_size=mesh.sp_size)) as sp:
        shard = sp.shard(batch)  # mm_token_type_ids / image_grid_thw are dropped: positions are given
        assert shard["position_ids"].shape == (batch["position_ids"].shape[0], batch["input_ids"].shape[0],
                                               shard["ulysses_mask"].seq_len // mesh.sp_size)
        loss = sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], mesh.sp_group))
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=mesh.sp_group)
            grads[name] = p.grad / mesh.sp_size  # DDP averages over ranks
        else:
            grads[name] = None
    return reported_loss(loss.detach(), mesh.sp_size, mesh.sp_group), grads


def check(family, kind, mesh):
    ref_loss, ref_grads = reference(family, kind)
    loss, grads = sp_run(family, kind, mesh)
    where = f"{family}/{kind}/P={mesh.sp_size}"
    # fp32: only summation order differs (shard-wise weight-grad sums, per-document kernels), as in
    # test_hf_parity.py (observed here: loss <= 2e-7 relative, gradients <= 2e-6 of their max at P=2, 3);
    # wrong positions or documents give > 1e-2.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} loss: {m}")
    num_checked = 0
    for name, ref in ref_grads.items():
        if ref is None:  # the vision tower: not run on text batches, in either process
            assert grads[name] is None, f"{where}: {name} has a gradient under SP only"
            continue
        scale = ref.abs().max().clamp_min(1e-8)
        torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=1e-4,
                                   msg=lambda m, name=name: f"{where} grad {name}: {m}")
        num_checked += 1
    assert num_checked >= 2 * 9 + 3  # every decoder / embedding / norm / lm_head parameter


def image_batch(model, seed: int = 3) -> dict:
    """The 'padding' batch with real pixels: 6 patches of 3 x 1 x 2 x 2 values per image (grids 1x2x3,
    1x3x2, merge 1: one image token per patch), so the vision tower runs and its features replace the
    placeholder embeddings."""
    batch = vl_batch(model, "padding")
    batch["pixel_values"] = torch.randn(12, 12, generator=torch.Generator().manual_seed(seed))
    return batch


def check_images(family, mesh):
    """Image batch under SP (vision tower on every rank, merged embeddings sliced) against one process."""
    ref_model = tiny_vl_model(family, deepstack=True)
    batch = image_batch(ref_model)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw")}
    ref_loss = ref_model(**inputs, labels=batch["labels"], use_cache=False).loss
    ref_loss.backward()
    model = tiny_vl_model(family, deepstack=True)
    with UlyssesSP(model, mesh, UlyssesSPConfig(sp_size=mesh.sp_size)) as sp:
        shard = sp.shard(batch)
        loss = sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], mesh.sp_group))
        loss.backward()
    where = f"{family}/images/P={mesh.sp_size}"
    # fp32, summation order only (as check()); features merged on the wrong tokens or a vision-tower
    # gradient counted on every rank give > 1e-2
    torch.testing.assert_close(reported_loss(loss.detach(), mesh.sp_size, mesh.sp_group), ref_loss.detach(),
                               rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} loss: {m}")
    num_visual = 0
    for (name, p), (_, r) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert (p.grad is None) == (r.grad is None), f"{where}: {name}"
        if r.grad is None:
            continue
        dist.all_reduce(p.grad, group=mesh.sp_group)
        scale = r.grad.abs().max().clamp_min(1e-8)
        torch.testing.assert_close(p.grad / mesh.sp_size / scale, r.grad / scale, rtol=0, atol=1e-4,
                                   msg=lambda m, name=name: f"{where} grad {name}: {m}")
        num_visual += name.startswith("model.visual")
    assert num_visual > 0  # the vision tower was trained through the image tokens


IMAGE_PLAN = {2: ["qwen2_vl", "qwen3_vl"], 3: ["qwen3_vl"], 8: ["qwen3_vl"]}

PLAN = {
    1: [("qwen2_vl", "padding"), ("qwen3_vl", "packed")],
    2: [(f, k) for f in ("qwen2_vl", "qwen3_vl") for k in ("padding", "packed")],
    3: [(f, k) for f in ("qwen2_vl", "qwen3_vl") for k in ("padding", "packed")],
    4: [("qwen2_vl", "packed"), ("qwen3_vl", "padding")],
    8: [("qwen2_vl", "padding"), ("qwen3_vl", "packed")],  # P=8 > 4 heads: Ulysses x ring (4 x 2)
}


def _worker(rank, world):
    mesh = SPMesh.from_world(world)
    for family, kind in PLAN[world]:
        check(family, kind, mesh)
    for family in IMAGE_PLAN.get(world, []):
        check_images(family, mesh)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_mrope_loss_and_every_gradient_match_one_process(world):
    """Bug caught: MRoPE text towers trained differently under SP than in one process: 3-D positions
    sliced along the wrong dim or not padded with S, documents of packed rows (from the text row) or
    padding lost, Qwen3-VL's text row not reaching the model. P=1 must equal plain transformers."""
    spawn(_worker, world)


def test_bug_caught_positions_sharded_along_sequence_and_documents_from_text_row():
    """Bug caught: (R, B, S) positions sliced on dim 1 (the batch, as ``[:, local]`` does for 2-D), not
    padded along S, or documents derived from an MRoPE row (constant / jumping inside an image: every
    image token would become its own document) instead of the text row."""
    model = tiny_vl_model("qwen3_vl")
    batch = vl_batch(model, "packed")
    pos = batch["position_ids"]  # (4, 1, 23)
    shards = [shard_batch(batch, r, 2) for r in range(2)]
    assert all(s["position_ids"].shape == (4, 1, 12) for s in shards)
    glued = torch.cat([s["position_ids"] for s in shards], dim=-1)
    assert torch.equal(glued[..., :23], pos) and torch.equal(glued[..., 23], pos[..., 22] + 1)  # pad continues
    text_docs = document_ids_from_position_ids(pos[0])
    assert text_docs[0].tolist() == [0] * 9 + [1] * 6 + [2] * 8
    assert not torch.equal(document_ids_from_position_ids(pos[1]), text_docs)  # the rows disagree: a real test
    assert torch.equal(shards[0]["ulysses_mask"].document_ids[:, :23], text_docs)
    # three rows: a document starts where all three restart at 0; the 1-D rule on any row splits images
    three = {**batch, "position_ids": pos[1:]}
    assert all(not torch.equal(document_ids_from_position_ids(row), text_docs) for row in pos[1:])
    assert torch.equal(shard_batch(three, 1, 3)["ulysses_mask"].document_ids[:, :23], text_docs)
    # one document with an image per row: the real tokens of a row stay one document (get_rope_index
    # gives padding (0, 0, 0), each a document of its own: harmless, padding is masked anyway)
    single = vl_batch(tiny_vl_model("qwen2_vl"), "padding")
    mask = shard_batch(single, 0, 2)["ulysses_mask"]
    valid = single["attention_mask"].bool()
    assert all(mask.document_ids[b, :23][valid[b]].unique().numel() == 1 for b in range(2))


def test_image_batches_and_missing_rope_index_are_refused_with_the_fix():
    """Bug caught: an image batch or a batch without its rope index being sharded silently: each rank would
    merge all image features into its shard, or compute MRoPE positions from its shard only."""
    model = tiny_vl_model("qwen2_vl")
    batch = vl_batch(model, "padding")
    for key in ("pixel_values", "pixel_values_videos"):
        with pytest.raises(ValueError, match=f"{key}.*text tower here.*UlyssesSP.shard"):
            shard_batch({**batch, key: torch.zeros(12, 12)}, 0, 2)
    no_positions = {k: v for k, v in batch.items() if k != "position_ids"}
    with pytest.raises(ValueError, match=r"image_grid_thw.*FULL sequence.*get_rope_index"):
        shard_batch(no_positions, 0, 2)
    with pytest.raises(ValueError, match=r"\(3, batch, seq\) or \(4, batch, seq\)"):
        shard_batch({**batch, "position_ids": batch["position_ids"][:2]}, 0, 2)
    # a text-only batch needs no rope index: the model's default is arange on all rows, as shard_batch's
    text_only = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    assert shard_batch(text_only, 1, 2)["position_ids"].shape == (2, 12)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_models_are_accepted(family):
    """Bug caught: MRoPE text towers refused at setup (the ForConditionalGeneration class, sdpa)."""
    assert check_model_support(tiny_vl_model(family), UlyssesSPConfig(sp_size=2)) == "sdpa"


def test_register_a_vl_model_whose_top_level_config_has_no_use_cache():
    """Bug caught: register() read ``model.config.use_cache``, which VL configs built in code keep
    only in ``text_config`` (AttributeError), and would not have cleared the text tower's cache flag.
    register() clears the text config's flag and unregister() restores it."""
    class OneRankMesh:
        sp_size, dp_size, sp_rank, dp_rank, sp_group = 1, 1, 0, 0, None

    model = tiny_vl_model("qwen3_vl")
    text = model.config.get_text_config()
    text.use_cache = True
    with UlyssesSP(model, OneRankMesh()):
        assert text.use_cache is False
    assert text.use_cache is True


def test_mrope_positions_for_a_model_without_mrope_are_refused():
    """Bug caught: (3, B, S) positions given to a text-only model reached its rotary embedding and
    failed there with a shape error (or worse). UlyssesSP.shard refuses them naming the fix."""
    from tiny_models import tiny_model

    class OneRankMesh:
        sp_size, dp_size, sp_rank, dp_rank, sp_group = 1, 1, 0, 0, None

    ids = torch.randint(1, 100, (2, 12))
    with UlyssesSP(tiny_model("llama"), OneRankMesh()) as sp:
        with pytest.raises(ValueError, match="MRoPE.*give \\(batch, seq\\) position_ids"):
            sp.shard({"input_ids": ids, "position_ids": torch.arange(12).expand(3, 2, 12)})
