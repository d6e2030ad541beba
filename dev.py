#!/usr/bin/env python3
"""Set-up and entry points on a fresh machine with nothing but Python 3.10+.

    python3 dev.py run [ARGS...]   # the main job (``mmflax train``; ``mmflax ARGS``) in a .venv
    python3 dev.py test [ARGS...]  # the whole test suite (pytest ARGS) in a local .venv

The first call creates ``.venv`` and installs the package with its dev group; later calls
reinstall only when ``pyproject.toml`` changed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".installed"


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, cwd=ROOT)


def ensure_venv() -> None:
    """Creates .venv and installs the project (and its dev group) when needed."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == digest:
        return
    if not (BIN / "python").exists():
        print("dev.py: creating .venv", flush=True)
        venv.create(VENV, with_pip=True)
    python = str(BIN / "python")
    print("dev.py: installing multimesh_flax and its dev group into .venv", flush=True)
    _run(python, "-m", "pip", "install", "-q", "--upgrade", "pip>=25.1")
    _run(python, "-m", "pip", "install", "-q", "-e", ".", "--group", "dev")
    STAMP.write_text(digest)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "test"):
        print(__doc__)
        return 2
    ensure_venv()
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    if argv[0] == "run":
        cmd = [str(BIN / "mmflax"), *(argv[1:] or ["train"])]  # default: the main job
    else:
        # loadgroup: a module marked `xdist_group` (it shares an expensive fixture) runs on one
        # worker; every other test is handed out one at a time, the `heavy` ones first.
        cmd = [str(BIN / "python"), "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q"]
        cmd += argv[1:]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
