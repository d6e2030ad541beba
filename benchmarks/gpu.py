"""GPU section: tokens/s and model FLOPs utilisation of a gpt-small training step.

Runs only where JAX sees GPUs (``python -m benchmarks`` starts it in a child process without
``JAX_PLATFORMS=cpu``); elsewhere it writes ``{"skipped": ...}`` and exits cleanly.

On ``n`` GPUs: plain ``jax.jit`` data parallel over all of them, against ``parallelize_step``
of ``GPT(config, stages=S)`` with ``S = n`` stages (``S = 1`` on one GPU: the same model as
one task, which measures the runtime's overhead) and ``m = 4`` microbatches (1F1B) when
``S > 1``. Model FLOPs per token: ``6 N + 12 L T E`` (``N`` non-embedding parameters, ``L``
layers, ``T`` tokens per sequence, ``E`` width), against the datasheet's dense bf16 peak.

Usage: ``python -m benchmarks.gpu --out results/gpu.json [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _peak(device: Any) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in kind), None)


def _flops_per_token(cfg: Any, length: int, params: int) -> float:
    embedding = cfg.vocab_size * cfg.embed_dim + cfg.max_len * cfg.embed_dim
    return 6 * (params - embedding) + 12 * cfg.num_layers * length * cfg.embed_dim


def measure(quick: bool) -> dict[str, Any]:
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return {"skipped": f"no GPU (JAX backend {jax.default_backend()!r})", "rows": []}
    from benchmarks import _common

    n = len(gpus)
    stages = n if n > 1 and 12 % n == 0 else 1
    batch, length = (8, 256) if quick else (16, 1024)
    workload = _common.Workload("gpt-small", batch=max(batch, 4 * n), length=length)
    cfg = workload.config()
    params = _common.param_count(workload)
    tokens = workload.batch * workload.length
    rounds = 5 if quick else 20
    base = _common.build_jit(workload, "data-parallel 8", devices=n)
    _common.warm(base, 3)
    m = 4 if stages > 1 else 1
    pipe = _common.build_mpmd(workload, stages, m, "1f1b", devices=n)
    _common.warm(pipe, 3)
    pipe_t, base_t = _common.interleaved([pipe.step, base.step], rounds)
    out: dict[str, Any] = {"gpus": n, "device_kind": gpus[0].device_kind, "stages": stages}
    peak = _peak(gpus[0])
    per_token = _flops_per_token(cfg, workload.length, params)
    rows = []
    for name, t in (("jax.jit", base_t), (f"parallelize_step S={stages}", pipe_t)):
        seconds = _common.median(t)
        rate = tokens / seconds
        mfu = rate * per_token / (peak * n) if peak else None
        out[name] = {"step_ms": 1e3 * seconds, "tokens_per_s": rate, "mfu": mfu}
        rows.append(_common.row("GPU", f"gpt-small {name}: tokens/s", round(rate)))
        if mfu is not None:
            rows.append(_common.row("GPU", f"gpt-small {name}: MFU", round(mfu, 3)))
    ratio = _common.median(pipe_t) / _common.median(base_t)
    rows.append(_common.row("GPU", "gpt-small step / jax.jit", round(ratio, 3)))
    out.update(workload=workload.describe(), ratio=ratio, rows=rows)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    try:
        result = measure(args.quick)
    except ImportError as error:  # no usable JAX build on this machine
        result = {"skipped": f"JAX unavailable: {error}", "rows": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
