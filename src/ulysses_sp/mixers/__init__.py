"""Sequence parallelism for token-mixing layers outside attention (linear attention, state-space).

Main entry points:
    install_sp_mixers(model, mesh)     while SP is registered: every supported mixer runs its conv +
                                       recurrence on the whole sequence for 1/P of its heads, between
                                       two all-to-alls (``UlyssesSP.register`` calls it); ``.remove()``
    unsupported_mixer_reasons(model, sp_size, layer_types)
                                       why a hybrid cannot run under SP (``unsupported_reasons`` uses it)
    supported_mixers()                 the class names with an SP forward

Modules: ``gated_delta`` (Qwen3-Next / Qwen3.5 gated delta net), ``mamba2`` (Bamba,
GraniteMoeHybrid, NemotronH Mamba2 mixers), ``exchange`` (the multi-part seq->head all-to-all),
``sequence`` (padding, per-document runs, the conv on a subset of channels), ``registry``.
"""

from ulysses_sp.mixers.registry import SPMixers, install_sp_mixers, supported_mixers, unsupported_mixer_reasons

__all__ = ["SPMixers", "install_sp_mixers", "supported_mixers", "unsupported_mixer_reasons"]
