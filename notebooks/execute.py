"""Executes the notebooks and writes each paired ``.ipynb`` with its outputs.

The ``.py`` files (jupytext ``py:percent``) are the sources; the ``.ipynb`` files are built
from them so that they read well on a code host, pictures included::

    .venv/bin/python notebooks/execute.py                 # every notebook, full run
    .venv/bin/python notebooks/execute.py 01 07           # the notebooks whose names start so
    .venv/bin/python notebooks/execute.py --smoke --no-write   # a quick check of them all

``--smoke`` sets ``MMFLAX_SMOKE=1`` (the reduced setting the test suite runs); with it the
``.ipynb`` files are not written unless ``--write`` is given. Each notebook runs in a fresh
kernel, in this folder, and its wall time is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jupytext
import nbclient

HERE = Path(__file__).resolve().parent


def sources(prefixes: list[str]) -> list[Path]:
    """The notebook sources (``NN-name.py``) whose names start with one of ``prefixes``."""
    found = sorted(p for p in HERE.glob("[0-9][0-9]-*.py"))
    if prefixes:
        found = [p for p in found if any(p.name.startswith(x) for x in prefixes)]
    return found


def execute(source: Path, *, smoke: bool, timeout: int) -> object:
    """Runs ``source`` top to bottom in a fresh kernel; returns the executed notebook."""
    notebook = jupytext.read(source)
    previous = os.environ.get("MMFLAX_SMOKE")
    os.environ["MMFLAX_SMOKE"] = "1" if smoke else "0"
    try:
        client = nbclient.NotebookClient(
            notebook,
            timeout=timeout,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": str(HERE)}},
        )
        client.execute()
    finally:
        if previous is None:
            os.environ.pop("MMFLAX_SMOKE", None)
        else:
            os.environ["MMFLAX_SMOKE"] = previous
    return notebook


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", help="run only notebooks starting with these")
    parser.add_argument("--smoke", action="store_true", help="the test suite's reduced run")
    parser.add_argument("--write", action="store_true", help="write .ipynb even with --smoke")
    parser.add_argument("--no-write", action="store_true", help="never write .ipynb")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = parser.parse_args()
    write = not args.no_write and (args.write or not args.smoke)
    total = 0.0
    for source in sources(args.prefixes):
        start = time.perf_counter()
        notebook = execute(source, smoke=args.smoke, timeout=args.timeout)
        seconds = time.perf_counter() - start
        total += seconds
        if write:
            jupytext.write(notebook, source.with_suffix(".ipynb"))
        print(f"{source.name}: {seconds:.1f} s{' (written)' if write else ''}", flush=True)
    print(f"total: {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
