"""ulysses-sp: train Hugging Face language models on very long sequences with Ulysses sequence parallelism.

Main entry points:
    ulysses-sp (CLI)                `train` (the main job), `plan`, `bench`, `check`, `demo`
    UlyssesSPConfig                 sp_size, sp_attn_implementation and the memory features
                                    (ulysses_sp.config), shared by every integration below
    UlyssesTrainer / UlyssesSFTTrainer
                                    Transformers Trainer / TRL SFTTrainer with SP
                                    (ulysses_sp.integrations.trainer / .trl)
    UlyssesAccelerate               a custom Accelerate loop with SP (ulysses_sp.integrations.accelerate)
    UlyssesSP(model, mesh)          any supported HF causal LM in a plain torchrun loop
                                    (ulysses_sp.integrations.transformers)
    SPMesh.from_world(sp_size)      split an initialised torch.distributed world into dp x sp groups
    UlyssesAttention(sp_group, kernel) / RingAttention(sp_group)
                                    exact attention over a sequence sharded across sp ranks
    GlobalMask                      causal / packed-document / padding mask of the global sequence
"""

from ulysses_sp.attention import GlobalMask, UlyssesAttention
from ulysses_sp.comm import HeadPlan, SPMesh

__version__ = "0.1.0"
__all__ = ["GlobalMask", "HeadPlan", "SPMesh", "UlyssesAttention", "__version__"]
