"""RoPE scaling for ``ulysses-sp train``: extend a model past the length it was pretrained at.

    --rope-scaling linear|dynamic|yarn|llama3     transformers' ``rope_type``
    --rope-factor F                                new length / original length
    --rope-original-max-position-embeddings L      the pretrained length (default: the model's, on
                                                   resume the checkpoint's model's: pretrained_length)
    --rope-theta T                                 the RoPE base (alone: "ABF", a larger base)
    --rope-low-freq-factor, --rope-high-freq-factor  llama3 only (Llama 3.1's 1 and 4 by default)
    --max-position-embeddings N                    the length the model declares (default F x L)

:func:`apply_rope_scaling` writes transformers' own ``config.rope_parameters`` (and
``max_position_embeddings``) before the model is built, so the rotary embedding is the scaled one,
``save_pretrained`` writes it into ``config.json`` and ``from_pretrained`` rebuilds the same model.
What each type covers (:func:`covered_length`):

    linear    positions / F                     F x L (max_position_embeddings := F x L)
    yarn      NTK-by-parts + attention scale   F x L (max_position_embeddings := F x L)
    llama3    low frequencies / F, smoothed    F x L (max_position_embeddings := F x L)
    dynamic   NTK base from each batch's       any length: the frequencies follow the length
              length (transformers reads       (max_position_embeddings := L, the threshold)
              max_position_embeddings as L)

Under SP the length-dependent one (dynamic) is fed the GLOBAL length by
``ulysses_sp.integrations.rope`` (registered with the model); the others depend on positions only.
"""

from __future__ import annotations

import math
from typing import Any

SCALING_TYPES = ("linear", "dynamic", "yarn", "llama3")
_WITH_ORIGINAL = ("yarn", "llama3", "longrope")  # rope types whose parameters name the original length
_KEPT_KEYS = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")  # not scaling keys


def _rope_parameters(config: Any) -> dict[str, Any]:
    """The flat ``rope_parameters`` of ``config``'s text config (ValueError: none, or per layer type)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        raise ValueError(f"{type(config).__name__} has no rotary position embeddings (rope_parameters), so the "
                         "--rope-* options do not apply to it; drop them (its --seq-len limit is "
                         f"max_position_embeddings={getattr(config, 'max_position_embeddings', None)}).")
    if config.nested_rope_parameter_keys(params):
        raise ValueError(f"{type(config).__name__} has rope_parameters per layer type ({sorted(params)}); the "
                         "--rope-* options set one scaling for all layers: edit rope_parameters in its config.json "
                         "instead.")
    return params


def _check_values(margs: Any) -> None:
    scaling, factor = margs.rope_scaling, margs.rope_factor
    if scaling is None and (factor is not None or margs.rope_original_max_position_embeddings is not None):
        raise ValueError("--rope-factor / --rope-original-max-position-embeddings need a scaling type: add "
                         f"--rope-scaling {{{','.join(SCALING_TYPES)}}}.")
    if scaling is not None and scaling not in SCALING_TYPES:
        raise ValueError(f"--rope-scaling {scaling!r} is not one of {', '.join(SCALING_TYPES)}.")
    if scaling is not None and (factor is None or factor < 1):
        raise ValueError(f"--rope-scaling {scaling} needs --rope-factor F >= 1 (new length / original length), "
                         f"got {factor}.")
    for name in ("rope_original_max_position_embeddings", "max_position_embeddings", "rope_theta"):
        value = getattr(margs, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}.")
    if scaling == "dynamic" and margs.max_position_embeddings is not None:
        raise ValueError("--rope-scaling dynamic reads max_position_embeddings as the ORIGINAL length (its frequencies "
                         "follow each batch's length): give --rope-original-max-position-embeddings, not "
                         "--max-position-embeddings.")
    if scaling != "llama3" and (margs.rope_low_freq_factor, margs.rope_high_freq_factor) != (1.0, 4.0):
        raise ValueError("--rope-low-freq-factor / --rope-high-freq-factor belong to --rope-scaling llama3.")


def pretrained_length(config: Any) -> int:
    """The length ``config``'s model was pretrained at: ``original_max_position_embeddings`` of a YaRN /
    Llama 3 / LongRoPE scaling, ``max_position_embeddings / factor`` for linear, else ``max_position_embeddings``."""
    text = config.get_text_config()
    params = getattr(text, "rope_parameters", None)
    params = params if isinstance(params, dict) and not text.nested_rope_parameter_keys(params) else {}
    rope_type = params.get("rope_type", "default")
    if rope_type in _WITH_ORIGINAL and params.get("original_max_position_embeddings"):
        return int(params["original_max_position_embeddings"])
    if rope_type == "linear" and params.get("factor"):
        return int(text.max_position_embeddings / params["factor"])  # linear stores no original length
    return int(text.max_position_embeddings)


def apply_rope_scaling(config: Any, margs: Any, resumed: Any | None = None) -> Any:
    """Set the ``--rope-*`` / ``--max-position-embeddings`` options of ``margs`` on ``config`` (in place).

    ``config``: a transformers config (its text config is changed, for multimodal models); returned.
    ``resumed``: the config of the checkpoint a later stage resumes; the default original length is
    its :func:`pretrained_length` (else ``config``'s). No option given: ``config`` is left exactly
    as it is. ValueError (saying the fix) for a model without RoPE, per-layer-type rope
    parameters, or inconsistent values.
    """
    _check_values(margs)
    text = config.get_text_config()
    if margs.rope_scaling is None and margs.rope_theta is None:
        if margs.max_position_embeddings is not None:
            text.max_position_embeddings = margs.max_position_embeddings
        return config
    params = _rope_parameters(text)
    new = {k: params[k] for k in _KEPT_KEYS if k in params}
    new["rope_type"] = params.get("rope_type", "default")
    if margs.rope_theta is not None:
        new["rope_theta"] = float(margs.rope_theta)
    limit = margs.max_position_embeddings or text.max_position_embeddings
    if margs.rope_scaling is not None:
        original = margs.rope_original_max_position_embeddings or pretrained_length(resumed or config)
        factor = float(margs.rope_factor)
        new.update(rope_type=margs.rope_scaling, factor=factor)
        if margs.rope_scaling in _WITH_ORIGINAL:
            new["original_max_position_embeddings"] = int(original)
        if margs.rope_scaling == "llama3":
            new.update(low_freq_factor=float(margs.rope_low_freq_factor),
                       high_freq_factor=float(margs.rope_high_freq_factor))
        covered = int(factor * original)
        limit = int(original) if margs.rope_scaling == "dynamic" else (margs.max_position_embeddings or covered)
        if limit > covered:
            raise ValueError(f"--max-position-embeddings {limit} is longer than --rope-scaling {margs.rope_scaling} "
                             f"covers (--rope-factor {factor:g} x original {original} = {covered}); raise "
                             f"--rope-factor to {math.ceil(limit / original)} or lower --max-position-embeddings.")
    else:
        for key in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                    "beta_fast", "beta_slow", "attention_factor", "short_factor", "long_factor"):
            if key in params:  # --rope-theta alone keeps the model's own scaling
                new[key] = params[key]
    text.rope_parameters = new
    text.max_position_embeddings = limit
    text.validate_rope()  # transformers' own check of the keys each rope_type needs
    return config


def covered_length(config: Any) -> int | None:
    """The longest sequence ``config``'s positions cover; None: any (dynamic NTK follows the length).

    Default RoPE and linear scaling: ``max_position_embeddings``. YaRN / Llama 3 / LongRoPE: the larger
    of it and ``factor x original_max_position_embeddings`` (Qwen2.5 ships YaRN with
    max_position_embeddings at the original length). Models without RoPE: ``max_position_embeddings``.
    """
    text = config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict) or config.get_text_config().nested_rope_parameter_keys(params):
        return limit
    rope_type = params.get("rope_type", "default")
    if "dynamic" in rope_type:
        return None
    if rope_type in _WITH_ORIGINAL and params.get("factor") and params.get("original_max_position_embeddings"):
        scaled = int(params["factor"] * params["original_max_position_embeddings"])
        return scaled if limit is None else max(limit, scaled)
    return limit


def length_error(config: Any, seq_len: int) -> str | None:
    """Why ``seq_len`` is too long for ``config`` and the fix (the options that extend it); None if it fits."""
    covered = covered_length(config)
    if covered is None or seq_len <= covered:
        return None
    params = getattr(config.get_text_config(), "rope_parameters", None)
    if not isinstance(params, dict):
        return (f"--seq-len {seq_len} is longer than the model allows (max_position_embeddings={covered}; it has no "
                f"rotary embeddings to scale); use --seq-len <= {covered}.")
    rope_type = params.get("rope_type", "default")
    original = pretrained_length(config)
    suggested = rope_type if rope_type in SCALING_TYPES else "yarn"
    limit = config.get_text_config().max_position_embeddings
    now = "" if rope_type == "default" else f", rope_type {rope_type!r} with factor {params.get('factor')}"
    return (f"--seq-len {seq_len} is longer than the model's positions cover (max_position_embeddings={limit}{now}: "
            f"{covered} positions). Extend them to cover it, "
            f"e.g. --rope-scaling {suggested} --rope-factor {math.ceil(seq_len / original)} "
            f"--rope-original-max-position-embeddings {original} (linear, dynamic, yarn or llama3), or use "
            f"--seq-len <= {covered}.")
