"""One writer per run folder: a lock held while ``mmflax train`` writes a run.

Two runs writing one ``--out`` would interleave their checkpoints and metadata. `RunLock`
takes an exclusive, non-blocking ``flock`` on ``<run>/.lock`` and writes the holder's pid and
host into it; a second writer gets `RunFolderBusyError` naming that holder. The operating
system drops the lock when the holding process ends, however it ends (a crash or
``kill -9`` leaves no stale lock to delete by hand). Where ``fcntl`` is missing (Windows) the
lock is a no-op.

In a multi-process job every process writes the same folder; only process 0 takes the lock.

Example:
  >>> import tempfile
  >>> from pathlib import Path
  >>> run = Path(tempfile.mkdtemp())
  >>> with RunLock(run):
  ...     try:
  ...         RunLock(run).acquire()
  ...     except RunFolderBusyError as e:
  ...         print("busy:", "is being written by process" in str(e))
  busy: True
  >>> with RunLock(run):   # free again once the first writer is done
  ...     pass
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import IO

from multimesh_flax.cli.errors import RunFolderBusyError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"


class RunLock:
    """An exclusive lock on the run folder ``run_dir`` (created if missing)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Takes the lock.

        Raises:
            RunFolderBusyError: another process holds it.
        """
        if fcntl is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")  # noqa: SIM115 -- held open while the lock is held
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            raise RunFolderBusyError(
                f"Run folder '{self.path.parent}' is being written by process {holder}; two "
                "runs in one folder would overwrite each other's checkpoints. Wait for that "
                "run to end (or stop it), or pass another `--out`."
            ) from None
        file.seek(0)
        file.truncate()
        file.write(f"{os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        """Drops the lock (closing the file releases it)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
