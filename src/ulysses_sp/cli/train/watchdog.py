"""Name the rank that stalled, and end the run within ``--ddp-timeout`` (``ulysses-sp train`` workers).

Each worker runs a :class:`Heartbeat`: a daemon thread that bumps ``heartbeat/<rank>`` in the
launcher's TCP store (the ``MASTER_ADDR:MASTER_PORT`` store every env:// process group already uses)
once a second. A stopped (SIGSTOP), swapping or dead process stops bumping. Two paths end a run
whose rank stopped:

* **The watch.** Each rank also watches one peer (the next rank, so every rank is watched by
  exactly one other and the store sees two operations per rank per second at any world size). When
  the peer's counter has not moved for longer than ``--ddp-timeout`` and the peer has not finished,
  the watcher prints the diagnosis and stops the peer with SIGKILL when it runs on this host (a
  stopped process ignores the launcher's SIGTERM), or ends itself when it does not; the launcher then
  ends the run. This path does not depend on the collective backend honouring its timeout: a gloo
  collective whose peer was stopped mid-transfer was observed waiting on forever (1 run in 5).
* **The collective timeout.** A collective that waits longer than ``--ddp-timeout`` raises on the
  ranks that reached it; gloo's message says only "Timed out waiting 10000ms for recv", so the
  worker re-raises it with :func:`timeout_message`, which reads the counters and names the silent
  ranks (or says every rank is alive: ranks took different code paths).

Either way one message (the first path to report wins, through a store key) reads::

    ulysses-sp train: rank 0: a collective waited longer than the 10 s timeout (--ddp-timeout);
    rank 1 stopped responding (no heartbeat for 3 s): stalled ... or dead ...

NCCL reports its own timeouts from its watchdog thread by aborting the process; the launcher then
names the rank that exited.
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
    """This rank's liveness counter in the launcher's store, and the watch over the next rank's."""

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="ulysses-sp-heartbeat", daemon=True)

    @classmethod
    def start(cls, rank: int, world_size: int, timeout_s: float) -> Heartbeat | None:
        """Start beating and watching; None when there is no env:// store (then nothing is named)."""
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ or world_size < 2:
            return None
        beat = cls(rank, world_size, timeout_s)
        beat.thread.start()
        return beat

    def _beat(self) -> None:
        try:
            store = _store()
            store.set(_key(self.rank, "process"), f"{socket.gethostname()} {os.getpid()}")
            peer = (self.rank + 1) % self.world_size
            seen, moved = -1, time.monotonic()
            while not self._stop.is_set():
                store.add(_key(self.rank), 1)
                count = store.add(_key(peer), 0)
                now = time.monotonic()
                if count != seen:
                    seen, moved = count, now
                elif now - moved > self.timeout_s and not store.check([_key(peer, "done")]):
                    self._end_silent_peer(peer, now - moved)
                    return
                self._stop.wait(INTERVAL_S)
        except Exception:  # the store went away (the run is ending): nothing left to report to
            return

    def _end_silent_peer(self, peer: int, silence: float) -> None:
        """The watched rank went silent for longer than the timeout: say so, then end the run."""
        local = self.local_processes([peer])
        ended = (f" (rank {peer} stopped with SIGKILL so that the run ends now)" if local else
                 f" (rank {self.rank} exits so that the run ends now)")
        report_once(f"rank {self.rank}: no heartbeat from rank {peer} for {silence:.0f} s, longer than the "
                    f"{self.timeout_s:g} s timeout (--ddp-timeout); rank {peer} stopped responding: stalled "
                    f"(stopped, swapping, a hung device) or dead{ended}. Raise --ddp-timeout only if a rank "
                    "can legitimately be unresponsive that long.")
        if local:
            self.stop_processes(local)
        else:
            os._exit(1)

    def stop(self) -> None:
        """Stop beating; a rank that stops is finished, so its watcher does not report it."""
        self._stop.set()
        try:
            _store().set(_key(self.rank, "done"), "1")
        except Exception:  # the store is gone: the run is over anyway
            pass

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


def report_once(message: str) -> None:
    """Print ``message`` to stderr unless another rank already reported this run's stall.

    The launcher reports whichever worker exits first (often the rank stopped here) and terminates
    the others, losing their errors: the diagnosis is printed before anything is stopped.
    """
    try:
        first = _store().add(_key(0, "reported"), 1) == 1
    except Exception:  # no store: print rather than lose it
        first = True
    if first:
        print(f"\nulysses-sp train: {message}", file=sys.stderr, flush=True)


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
            report_once(message)
            heartbeat.stop_processes(local)
        return message
    if silent == []:
        return (f"{head}, while every other rank is alive: ranks took different code paths or data (a rank "
                "skipped or repeated a collective). Raise --ddp-timeout only if steps legitimately take longer.")
    return f"{head}; another rank stalled or died (the launcher's report names a rank that exited)."
