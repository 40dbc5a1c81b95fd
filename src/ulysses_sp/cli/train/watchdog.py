"""Name the rank that stalled when a collective times out (``ulysses-sp train`` workers).

A collective that waits longer than ``--ddp-timeout`` raises on the ranks that reached it; gloo's
message says only "Timed out waiting 10000ms for recv". Each worker therefore runs a
:class:`Heartbeat`: a daemon thread that bumps ``heartbeat/<rank>`` in the launcher's TCP store
(the ``MASTER_ADDR:MASTER_PORT`` store every env:// process group already uses) once a second.
A stopped (SIGSTOP), swapping or dead process stops bumping. On a timeout the surviving ranks read
the counters twice and name the ranks whose counters did not move, and stop those of them that run
on the same host with SIGKILL (a stopped process ignores the launcher's SIGTERM, which would keep the
run alive 30 s longer)::

    rank 0: a collective waited longer than the 10 s timeout (--ddp-timeout); rank 1 stopped
    responding (no heartbeat for 3 s): it is stalled or dead. ...

NCCL reports timeouts from its watchdog thread by aborting the process instead of raising; the
launcher then names the rank that exited.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

INTERVAL_S = 1.0


def _store() -> dist.TCPStore:
    """A client of the launcher's store (the one ``init_process_group(init_method="env://")`` joined)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=30))


def _key(rank: int, what: str = "heartbeat") -> str:
    return f"ulysses_sp/{what}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


class Heartbeat:
    """This rank's liveness counter in the launcher's store, bumped by a daemon thread."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ulysses-sp-heartbeat", daemon=True)

    @classmethod
    def start(cls, rank: int, world_size: int) -> Heartbeat | None:
        """Start beating; None when there is no env:// store to beat into (then nothing is named)."""
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ or world_size < 2:
            return None
        beat = cls(rank, world_size)
        beat._thread.start()
        return beat

    def _beat(self) -> None:
        try:
            store = _store()
            store.set(_key(self.rank, "process"), f"{socket.gethostname()} {os.getpid()}")
            while not self._stop.is_set():
                store.add(_key(self.rank), 1)
                self._stop.wait(INTERVAL_S)
        except Exception:  # the store went away (the run is ending): nothing left to report to
            return

    def stop(self) -> None:
        self._stop.set()

    def silent_ranks(self) -> tuple[list[int], float]:
        """Ranks (other than this one) whose counter did not move over a few intervals, and the wait."""
        store = _store()
        ranks = [r for r in range(self.world_size) if r != self.rank]
        before = [store.add(_key(r), 0) for r in ranks]
        wait = 3 * INTERVAL_S
        time.sleep(wait)
        after = [store.add(_key(r), 0) for r in ranks]
        return [r for r, a, b in zip(ranks, before, after) if a == b], wait

    def local_processes(self, ranks: list[int]) -> dict[int, int]:
        """The pids of the given ranks' processes that run on this host (rank -> pid)."""
        store, host, found = _store(), socket.gethostname(), {}
        for rank in ranks:
            try:
                their_host, pid = store.get(_key(rank, "process")).decode().rsplit(" ", 1)
                if their_host == host:
                    found[rank] = int(pid)
            except (ValueError, RuntimeError):
                continue
        return found

    @staticmethod
    def stop_processes(pids: dict[int, int]) -> list[int]:
        """SIGKILL the given processes (rank -> pid); the ranks stopped."""
        stopped = []
        for rank, pid in pids.items():
            try:
                os.kill(pid, signal.SIGKILL)
                stopped.append(rank)
            except OSError:
                continue
        return stopped


def is_timeout(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a collective timing out."""
    seen: BaseException | None = err
    while seen is not None:
        text = str(seen).lower()
        if "timed out" in text or "timeout" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def timeout_message(rank: int, timeout_s: float, heartbeat: Heartbeat | None) -> str:
    """The error a rank raises when one of its collectives timed out (names the silent ranks)."""
    head = (f"rank {rank}: a collective waited longer than the {timeout_s:g} s timeout (--ddp-timeout)")
    try:
        silent, wait = heartbeat.silent_ranks() if heartbeat is not None else (None, 0.0)
    except Exception:  # the store is gone too: say what is known
        silent, wait = None, 0.0
    if silent:
        who = ", ".join(str(r) for r in silent)
        local = heartbeat.local_processes(silent) if heartbeat is not None else {}
        ended = (f" (rank {', '.join(map(str, local))} stopped with SIGKILL so that the run ends now)"
                 if local else "")
        message = (f"{head}; rank {who} stopped responding (no heartbeat for {wait:.0f} s): stalled (stopped, "
                   f"swapping, a hung device) or dead{ended}. Raise --ddp-timeout only if steps legitimately "
                   "take longer.")
        if local:
            # The launcher reports whichever worker exits first, often the rank killed here, and then
            # terminates this one: print the diagnosis before the kill so that it is never lost.
            print(f"ulysses-sp train: {message}", file=sys.stderr, flush=True)
            heartbeat.stop_processes(local)
        return message
    if silent == []:
        return (f"{head}, while every other rank is alive: ranks took different code paths or data (a rank "
                "skipped or repeated a collective). Raise --ddp-timeout only if steps legitimately take longer.")
    return f"{head}; another rank stalled or died (the launcher's report names a rank that exited)."
