"""One run per output directory: ``DIR.lock`` names the process writing ``DIR``.

    acquire   create ``DIR.lock`` atomically (O_EXCL) with this process's pid, host and start time.
              If it exists: a live process on this host -> refused (the message names it); a dead
              pid on this host -> a stale lock from a killed run: taken over; another host -> refused
              (liveness cannot be checked from here: the message says how to clear it).
    release   remove the lock if it is still ours (at the end of the launch, success or failure).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path


class OutputLockedError(ValueError):
    """Another live run writes the same output directory."""


def lock_path(output_dir: Path) -> Path:
    return output_dir.with_name(output_dir.name + ".lock")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def acquire(output_dir: Path) -> Path:
    """Take ``DIR.lock`` for this process; :class:`OutputLockedError` if a live run holds it."""
    path = lock_path(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                other = json.loads(path.read_text() or "{}")
            except (OSError, ValueError):
                other = {}
            pid, host = other.get("pid"), other.get("host")
            if host == mine["host"] and isinstance(pid, int) and not _alive(pid):
                path.unlink(missing_ok=True)  # stale: the run that held it is gone
                continue
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(other.get("started", 0)))
            where = f"pid {pid} on {host}, started {since}" if pid else "an unknown process"
            fix = ("wait for it to finish, or choose another --output-dir" if host == mine["host"] else
                   f"if that run is gone, delete {path}; otherwise choose another --output-dir")
            raise OutputLockedError(f"--output-dir {output_dir} is being written by another run ({where}): {fix}.")
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        return path
    raise OutputLockedError(f"could not take {path}: another run took it at the same moment; try again.")


def release(output_dir: Path) -> None:
    """Remove ``DIR.lock`` if this process holds it."""
    path = lock_path(output_dir)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass
