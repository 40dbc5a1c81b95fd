"""Local input checks of the exchanges, written once (no process group; the checks across ranks are in
``comm.collectives``).

    check_one_dtype(what, *tensors, purpose)    ValueError unless the tensors share one dtype
"""

from __future__ import annotations

import torch


def check_one_dtype(what: str, *tensors: torch.Tensor, purpose: str = "") -> None:
    """Raise ``ValueError`` unless ``tensors`` share one dtype (one buffer carries them all).

    Args:
        what: the tensors as the message names them, e.g. ``"q, k and v"``.
        tensors: any shapes.
        purpose: appended after "share one dtype", e.g. ``" for the fused exchange"``.
    """
    dtypes = [t.dtype for t in tensors]
    if len(set(dtypes)) > 1:
        raise ValueError(
            f"{what} must share one dtype{purpose}, got {', '.join(map(str, dtypes))}; cast them "
            "(e.g. run the model under one dtype / autocast) first."
        )
