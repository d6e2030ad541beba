"""The ``mmflax`` command line.

``mmflax`` (or ``mmflax demo``) runs the placement demo: a two-layer function on two
submeshes of 8 simulated CPU devices, printing where every array lives. Bad arguments print a
message and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys


def _configure_devices(count: int) -> None:
    """Gives the CPU backend ``count`` simulated devices (before any JAX operation)."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmflax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="place a two-layer function on two submeshes")
    demo.add_argument("--devices", type=int, default=8, help="simulated CPU devices (even)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mmflax`` console script."""
    args = _parser().parse_args(argv)
    if args.command is None:
        args = _parser().parse_args(["demo", *(argv or [])])
    if args.devices < 2 or args.devices % 2:
        print(f"mmflax: --devices must be an even number >= 2, got {args.devices}", file=sys.stderr)
        return 2
    _configure_devices(args.devices)
    from multimesh_flax import _demo

    return _demo.run(args.devices)


if __name__ == "__main__":
    sys.exit(main())
