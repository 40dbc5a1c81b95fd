"""Process groups, head-split layout math and the autograd all-to-all (no model knowledge)."""

from ulysses_sp.comm.all_to_all import head_to_seq_out, seq_to_head_qkv
from ulysses_sp.comm.layout import HeadPlan
from ulysses_sp.comm.mesh import SPMesh

__all__ = ["HeadPlan", "SPMesh", "head_to_seq_out", "seq_to_head_qkv"]
