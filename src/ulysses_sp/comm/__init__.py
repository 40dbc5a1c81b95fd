"""Process groups, head-split layout math, the autograd all-to-all and the small collectives.

No model knowledge lives here.

    SPMesh.from_world(sp_size)     dp x sp DeviceMesh over an initialised world; check_sp_size
    HeadPlan(N, K, P)              pure layout math of the head <-> sequence exchange
    seq_to_head_qkv / head_to_seq_out
                                   the autograd all-to-alls (one for q|k|v, one for the output);
                                   head_chunked.head_chunked_attention: one chunk of heads at a time
    collectives                    collective_device, gather_signature, check_same_across_ranks,
                                   all_reduce_sum: written once, used by every layer above
    CommCounter                    counts collectives and bytes sent (instrumentation for the bench,
                                   the demo and tests); attention_comm: the per-layer formulas
    spawn(fn, world_size)          local processes with an initialised world (tests, CLI);
                                   local_backend: nccl with a GPU per rank, else gloo (GPUs shared)
"""

from ulysses_sp.comm.all_to_all import head_to_seq_out, seq_to_head_qkv
from ulysses_sp.comm.collectives import all_reduce_sum, check_same_across_ranks, collective_device, gather_signature
from ulysses_sp.comm.cost import AttentionComm, attention_comm
from ulysses_sp.comm.counting import CommCounter, CommRecord
from ulysses_sp.comm.launch import close_world, free_port, local_backend, spawn
from ulysses_sp.comm.layout import HeadPlan
from ulysses_sp.comm.mesh import DEFAULT_TIMEOUT_S, SPMesh, check_sp_size

__all__ = [
    "DEFAULT_TIMEOUT_S", "AttentionComm", "CommCounter", "CommRecord", "HeadPlan", "SPMesh", "all_reduce_sum",
    "attention_comm",
    "check_same_across_ranks", "check_sp_size", "close_world", "collective_device", "free_port", "gather_signature",
    "local_backend",
    "head_to_seq_out", "seq_to_head_qkv", "spawn",
]
