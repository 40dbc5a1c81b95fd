"""Tiny random Transformers causal LMs built in code (no downloads), one per supported family."""

import torch
import transformers as tf

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
              pad_token_id=0, tie_word_embeddings=False)


def tiny_config(family: str):
    """(config, attn_implementation) for a family name."""
    if family == "llama":
        return tf.LlamaConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2), "sdpa"
    if family == "llama_mha_eager":
        return tf.LlamaConfig(**COMMON, num_attention_heads=8, num_key_value_heads=8), "eager"
    if family == "llama_n2":  # fewer query heads than ranks (ring backend only)
        return tf.LlamaConfig(**COMMON, num_attention_heads=2, num_key_value_heads=1), "sdpa"
    if family == "llama_n4k1":  # 4 query heads, 1 kv head: Ulysses x ring at P=8
        return tf.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1), "sdpa"
    if family == "llama_k1":  # GQA with K=1 < P
        return tf.LlamaConfig(**COMMON, num_attention_heads=8, num_key_value_heads=1), "sdpa"
    if family == "llama_bias":  # q/k/v and o_proj biases (o_proj's must be added once, not per head block)
        return tf.LlamaConfig(**COMMON, num_attention_heads=8, num_key_value_heads=4, attention_bias=True), "sdpa"
    if family == "mistral":  # sliding window shorter than the sequence
        return tf.MistralConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, sliding_window=7), "sdpa"
    if family == "qwen2":  # q/k/v bias
        return tf.Qwen2Config(**COMMON, num_attention_heads=8, num_key_value_heads=2), "sdpa"
    if family == "qwen3":  # q/k RMSNorm, head_dim decoupled from hidden
        return tf.Qwen3Config(**COMMON, num_attention_heads=6, num_key_value_heads=2, head_dim=16), "sdpa"
    if family == "gemma2":  # logit softcapping, alternating sliding window, query_pre_attn_scalar
        return tf.Gemma2Config(**COMMON, num_attention_heads=8, num_key_value_heads=4, head_dim=16, sliding_window=6,
                               attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                               query_pre_attn_scalar=16), "eager"
    if family == "gemma3":
        cfg = tf.Gemma3TextConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=6,
                                  query_pre_attn_scalar=16)
        return cfg, "sdpa"
    if family == "stablelm":  # decoder layers call attention without **kwargs; partial rotary, qkv bias
        return tf.StableLmConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, use_qkv_bias=True,
                                 partial_rotary_factor=0.5), "sdpa"
    if family == "nemotron":  # decoder layers call attention without **kwargs; relu2 MLP, layernorm1p
        return tf.NemotronConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2), "sdpa"
    if family == "phi3":  # fused qkv projection
        return tf.Phi3Config(**COMMON, num_attention_heads=8, num_key_value_heads=4), "sdpa"
    if family == "phi3_longrope":  # LongRoPE (Phi-3 128k style): short / long factors by sequence length
        half = 4  # head_dim 8 / 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                "long_factor": [1.5, 3.0, 6.0, 12.0], "original_max_position_embeddings": 16}
        return tf.Phi3Config(**{**COMMON, "max_position_embeddings": 64}, num_attention_heads=8, num_key_value_heads=4,
                             original_max_position_embeddings=16, rope_parameters=rope), "sdpa"
    if family == "llama_dynamic":  # dynamic NTK: frequencies recomputed for sequences past max_position_embeddings
        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
        return tf.LlamaConfig(**{**COMMON, "max_position_embeddings": 16}, num_attention_heads=8, num_key_value_heads=2,
                              rope_parameters=rope), "sdpa"
    if family == "cohere":  # logits multiplied by logit_scale after lm_head (Command-R)
        return tf.CohereConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, logit_scale=0.25), "sdpa"
    if family == "granite":  # logits divided by logits_scaling after lm_head
        return tf.GraniteConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, logits_scaling=8.0), "sdpa"
    if family == "mixtral_aux":  # MoE trained with the router load-balancing loss (output_router_logits=True)
        return tf.MixtralConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, num_local_experts=4,
                                num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5), "sdpa"
    if family == "qwen3_moe_aux":
        return tf.Qwen3MoeConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=8, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True,
                                 router_aux_loss_coef=0.5), "sdpa"
    if family == "gpt_oss":  # attention sinks (one learned logit per head), sliding/full layers, MoE, eager
        cfg = tf.GptOssConfig(**COMMON, num_attention_heads=6, num_key_value_heads=2, head_dim=16, sliding_window=6,
                              num_local_experts=4, num_experts_per_tok=2,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return cfg, "eager"
    if family == "gpt2":  # Conv1D projections that flatten with .view, learned absolute positions, MHA
        # no dropout: both runs deterministic
        return tf.GPT2Config(vocab_size=128, n_embd=64, n_head=8, n_layer=2, n_positions=256, n_inner=96,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "sdpa"
    if family == "gemma3_vlm":  # image tokens (token_type_ids 1) attend bidirectionally in its own mask
        cfg = tf.Gemma3Config(
            text_config={**COMMON, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
                         "sliding_window": 6},
            vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14),
            mm_tokens_per_image=4, image_token_index=5, boi_token_index=6, eoi_token_index=7)
        return cfg, "sdpa"
    raise KeyError(family)


def tiny_model(family: str, seed: int = 0):
    config, attn = tiny_config(family)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # larger than the default init so attention patterns matter
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("sinks"):  # sink logits comparable to the scores, so the sinks take a real share
                p.normal_(0, 1.0)
    return model


def tiny_batch(kind: str, seed: int = 1) -> dict:
    """Global batches: 'plain' (B=2, S=24), 'padding' (B=2, S=23, right and left padding),
    'packed' (B=1, S=23 with three documents in position_ids), 'odd' (B=1, S=21)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "plain":
        return {"input_ids": torch.randint(1, 128, (2, 24), generator=gen)}
    if kind == "odd":
        return {"input_ids": torch.randint(1, 128, (1, 21), generator=gen)}
    if kind == "padding":
        ids = torch.randint(1, 128, (2, 23), generator=gen)
        am = torch.ones(2, 23, dtype=torch.long)
        am[0, 18:] = 0
        am[1, :3] = 0
        ids[am == 0] = 0
        labels = ids.masked_fill(am == 0, -100)
        labels[1, 3] = -100  # predicted from a padding position: undefined (kernel-dependent) in transformers
        return {"input_ids": ids, "attention_mask": am, "labels": labels}
    if kind == "packed":
        ids = torch.randint(1, 128, (1, 23), generator=gen)
        pos = torch.cat([torch.arange(9), torch.arange(5), torch.arange(9)])[None]
        return {"input_ids": ids, "position_ids": pos}
    if kind == "packed_long":  # a 20-token document and a 4-token one: the row's largest position is 19
        ids = torch.randint(1, 128, (1, 24), generator=gen)
        return {"input_ids": ids, "position_ids": torch.cat([torch.arange(20), torch.arange(4)])[None]}
    raise KeyError(kind)
