"""GPU section: tokens/s and model FLOPs utilisation of a gpt-small training step.

Runs only where JAX sees GPUs (``python -m benchmarks`` starts it in a child process without
``JAX_PLATFORMS=cpu``); elsewhere it writes ``{"skipped": ...}`` and exits cleanly.

On ``n`` GPUs: plain ``jax.jit`` data parallel over all of them (accumulating the same
microbatches in its one program), against ``parallelize_step``
of ``GPT(config, stages=S)`` with ``S = n`` stages (``S = 1`` on one GPU: the same model as
one task, which measures the runtime's overhead) and ``m = 4`` microbatches (1F1B) when
``S > 1``; on one GPU also ``m = 8`` against ``jax.jit`` accumulating the same 8 microbatches,
with the step's extra time over ``jax.jit`` per op the runtime dispatches (issue 40: what each
op costs a GPU's host). Model FLOPs per token: ``6 N + 12 L T E`` (``N`` non-embedding
parameters, ``L`` layers, ``T`` tokens per sequence, ``E`` width), against the datasheet's
dense bf16 peak.

Usage: ``python -m benchmarks.gpu --out results/gpu.json [--quick] [--model gpt-tiny]``
(``--model``: any preset of ``models``; gpt-tiny compiles in seconds where gpt-small's
first compile on an H100 took minutes).
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


def measure(quick: bool, model: str = "gpt-small") -> dict[str, Any]:
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return {"skipped": f"no GPU (JAX backend {jax.default_backend()!r})", "rows": []}
    from benchmarks import _common

    n = len(gpus)
    stages = n if n > 1 and 12 % n == 0 else 1
    batch, length = (8, 256) if quick else (16, 1024)
    length = min(length, _common.Workload(model, batch=1, length=1).config().max_len)
    workload = _common.Workload(model, batch=max(batch, 4 * n), length=length)
    cfg = workload.config()
    params = _common.param_count(workload)
    tokens = workload.batch * workload.length
    rounds = 5 if quick else 20
    out: dict[str, Any] = {"gpus": n, "device_kind": gpus[0].device_kind, "stages": stages}
    peak = _peak(gpus[0])
    per_token = _flops_per_token(cfg, workload.length, params)
    rows = []
    for m in (1, 8) if stages == 1 else (4,):
        pair = _pair(workload, stages, m, n, rounds)
        for name in ("jax.jit", "parallelize_step"):
            seconds = pair[name]["step_s"]
            rate = tokens / seconds
            mfu = rate * per_token / (peak * n) if peak else None
            pair[name] |= {"tokens_per_s": rate, "mfu": mfu}
            label = f"{model} m={m} {name}{f' S={stages}' if name != 'jax.jit' else ''}"
            rows.append(_common.row("GPU", f"{label}: tokens/s", round(rate)))
            if mfu is not None:
                rows.append(_common.row("GPU", f"{label}: MFU", round(mfu, 3)))
        rows.append(_common.row("GPU", f"{model} m={m} step / jax.jit", round(pair["ratio"], 3)))
        extra = f"{pair['ops_per_step']}; {pair['extra_us_per_op']:.0f} us"
        rows.append(_common.row("GPU", f"{model} m={m}: ops per step; extra time per op", extra))
        out[f"m={m}"] = pair
    out.update(workload=workload.describe(), ratio=out[f"m={1 if stages == 1 else 4}"]["ratio"],
               rows=rows)  # fmt: skip
    return out


def _pair(workload: Any, stages: int, m: int, n: int, rounds: int) -> dict[str, Any]:
    """``parallelize_step`` (``stages`` stages, ``m`` microbatches, 1F1B) against ``jax.jit``
    data parallel over the ``n`` GPUs, accumulating the same ``m`` microbatches in its one
    program; interleaved rounds, medians. ``extra_us_per_op``: the step's time beyond
    ``jax.jit``'s, over the ops the runtime dispatches per step (recorded once)."""
    import multimesh_flax as mm
    from benchmarks import _common

    base = _common.build_jit(workload, "data-parallel 8", devices=n, microbatches=m)
    _common.warm(base, 3)
    pipe = _common.build_mpmd(workload, stages, m, "1f1b", devices=n)
    _common.warm(pipe, 3)
    with mm.record_timeline() as timeline:
        pipe.step()
    ops = len(timeline.events)  # fragments and transfers
    pipe_t, base_t = _common.interleaved([pipe.step, base.step], rounds)
    ours, theirs = _common.median(pipe_t), _common.median(base_t)
    _common.release(pipe, base)
    return {
        "jax.jit": {"step_s": theirs},
        "parallelize_step": {"step_s": ours},
        "ratio": ours / theirs,
        "ops_per_step": ops,
        "extra_us_per_op": 1e6 * (ours - theirs) / ops,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="gpt-small", help="a preset of models")
    args = parser.parse_args(argv)
    try:
        result = measure(args.quick, args.model)
    except ImportError as error:  # no usable JAX build on this machine
        result = {"skipped": f"JAX unavailable: {error}", "rows": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
