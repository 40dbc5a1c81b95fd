"""``benchmarks/live_tensors.py``: the tracker behind the layer-goal figures of ``head_block_memory.py``.

Those figures say what is alive at a peak; this checks the tracker counts exactly the storages ops
allocate, for as long as they live, in the right category.
"""

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "live_tensors.py"


def _load():
    spec = importlib.util.spec_from_file_location("live_tensors", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tracker_counts_what_ops_allocate_while_it_lives():
    """Bug caught: the tracker counting a view or a tensor made before it started, keeping a freed
    storage (dropped, or freed in place by ``resize_(0)`` as the exchanges do), missing a storage
    allocated where a freed one was, or putting a head-sharded full-length tensor, a flat exchange
    buffer or the log-sum-exp in the wrong category."""
    live_tensors = _load()
    S, MiB = 1024, 2**20
    before = torch.zeros(S, 256)  # made before: not counted, nor its views
    with live_tensors.LiveTensors(live_tensors.sequence_classifier(S), combined=("full-length", "exchange")) as live:
        view = before.view(-1)[: S * 8]
        full = torch.empty(1, 2, S, 128)  # 1 MiB, a dim of S: full-length
        flat = torch.empty(S * 256)  # 1 MiB, flat: exchange
        lse = torch.empty(1, 2, S)  # the kernel's log-sum-exp
        sharded = torch.empty(1, S // 2, 512)  # 1 MiB, sequence-sharded
        assert live.peak == 3 * MiB + lse.nbytes
        flat.untyped_storage().resize_(0)  # freed in place
        del full
        again = torch.empty(1, 4, S, 64)  # 1 MiB again, maybe where `full` was
        assert live.peak == 3 * MiB + lse.nbytes  # the freed ones no longer count
        del again
        bigger = torch.empty(1, 2, S, 384)  # 3 MiB full-length: the new peak
    assert live.peak == 4 * MiB + lse.nbytes
    assert live.peak_by_category == {"full-length": 3 * MiB, "sharded": MiB, "lse": lse.nbytes}
    assert live.max_by_category["exchange"] == MiB
    assert live.max_combined == 3 * MiB  # full 1 + flat 1 at first, then `bigger` alone
    del view, sharded, bigger
