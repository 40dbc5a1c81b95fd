"""The helpers the tests use to run distributed code: a function on a gloo process group of N CPU
processes (:func:`spawn`), and a launcher command that starts ranks itself (:func:`run_launcher`)."""

import os
import signal
import subprocess

from ulysses_sp.comm import launch

# imported once by the fork server, then shared by every worker of every test
PRELOAD = ["transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "ulysses_sp.attention", "tiny_models"]


def spawn(fn, world_size, *args, timeout_s=300.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; re-raise any rank's error."""
    launch.spawn(fn, world_size, *args, timeout_s=timeout_s, preload=PRELOAD)


def run_launcher(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)`` for a command that
    starts ranks (``torchrun``, ``accelerate launch``): on a timeout the whole process group goes, so no
    rank is left waiting on a dead peer (and taking the cores of the tests after it), then
    ``TimeoutExpired`` is raised with what the command printed."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
