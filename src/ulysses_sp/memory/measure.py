"""Peak memory of a stretch of code on one rank: the one measurement the bench and the benchmarks share.

    base = memory_mark(device)      CUDA: reset the peak, return the bytes allocated now;
                                    CPU: reset this process's VmHWM to its VmRSS, return VmRSS
    ...                             the code measured
    peak = memory_peak(device) - base

On CPU this is page-level: it follows the live tensors only where the allocator returns freed memory
to the system at once (glibc: ``mallopt(M_MMAP_THRESHOLD, ...)``, which the callers set).
"""

from __future__ import annotations

import torch


def process_status_bytes(field: str) -> int:
    """``field`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_mark(device: torch.device) -> int:
    """Start a peak measurement on ``device``; the bytes in use now (module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return process_status_bytes("VmRSS")


def memory_peak(device: torch.device) -> int:
    """The most bytes in use since :func:`memory_mark` (subtract the mark)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return process_status_bytes("VmHWM")
