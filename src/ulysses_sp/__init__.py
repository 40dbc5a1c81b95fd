"""ulysses-sp: train Hugging Face language models on very long sequences with Ulysses sequence parallelism.

Main entry points:
    SPMesh.from_world(sp_size)      split an initialised torch.distributed world into dp x sp groups
    UlyssesAttention(sp_group, kernel)
                                    exact attention over a sequence sharded across sp ranks
    GlobalMask                      causal / packed-document / padding mask of the global sequence
    ulysses-sp (CLI)                `ulysses-sp demo`, see `ulysses-sp --help`
"""

from ulysses_sp.attention import GlobalMask, UlyssesAttention
from ulysses_sp.comm import HeadPlan, SPMesh

__version__ = "0.1.0"
__all__ = ["GlobalMask", "HeadPlan", "SPMesh", "UlyssesAttention", "__version__"]
