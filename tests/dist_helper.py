"""The one helper the tests use to run a function on a gloo process group of N CPU processes."""

from ulysses_sp.comm import launch

# imported once by the fork server, then shared by every worker of every test
PRELOAD = ["transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "ulysses_sp.attention", "tiny_models"]


def spawn(fn, world_size, *args, timeout_s=300.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; re-raise any rank's error."""
    launch.spawn(fn, world_size, *args, timeout_s=timeout_s, preload=PRELOAD)
