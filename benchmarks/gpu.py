"""GPU section: tokens/s and model FLOPs utilisation of a gpt-small training step.

Runs only where JAX sees GPUs (``python -m benchmarks`` starts it in a child process without
``JAX_PLATFORMS=cpu``); elsewhere it writes ``{"skipped": ...}`` and exits cleanly.

On ``n`` GPUs: plain ``jax.jit`` data parallel over all of them (accumulating the same
microbatches in its one program), against ``parallelize_step``
of ``GPT(config, stages=S)`` with ``S = n`` stages (``S = 1`` on one GPU: the same model as
one task, which measures the runtime's overhead) and ``m = 4`` microbatches (1F1B) when
``S > 1``; on one GPU also ``m = 8`` against ``jax.jit`` accumulating the same 8 microbatches,
with the step's extra time over ``jax.jit`` per op the runtime dispatches (issue 40: what each
op costs a GPU's host), and the time until the step's call returns, before its results are
ready (``issue_s``: the host's share; where it nears the step time, the devices wait for the
host), split into the dispatching thread's CPU time in the runtime's own work and inside
JAX's calls of its ops (``_breakdown.runtime_cpu_seconds``); and what JAX's call of a
compiled program costs the host by arrays and kernels (``_breakdown.jax_call_costs``).

Model FLOPs per token: ``6 N + 12 L T E`` (``N`` non-embedding parameters, ``L`` layers,
``T`` tokens per sequence, ``E`` width), against the datasheet's dense bf16 peak.

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
    from benchmarks import _breakdown, _common

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
        ours = pair["parallelize_step"]
        issue = (
            f"{1e3 * ours['issue_s']:.1f} of {1e3 * ours['step_s']:.1f} ms;"
            f" {pair['issue_us_per_op']:.0f} us"
        )
        label = f"{model} m={m}: host issuing the step, of its time; per op"
        rows.append(_common.row("GPU", label, issue))
        cpu = (
            f"{1e3 * ours['runtime_cpu_s']:.2f} / {1e3 * ours['inside_jax_calls_cpu_s']:.2f};"
            f" {1e3 * pair['jax.jit']['host_cpu_s']:.2f}"
        )
        label = (
            f"{model} m={m}: host CPU per step, the runtime's own / inside JAX's calls of its"
            " ops; jax.jit's whole step (ms)"
        )
        rows.append(_common.row("GPU", label, cpu))
        out[f"m={m}"] = pair
    costs = out["jax_call_us"] = _breakdown.jax_call_costs()
    arrays = f"{costs['in 1 out 1']:.0f} / {costs['in 300 out 300']:.0f}"
    kernels = f"{costs['chain 1']:.0f} / {costs['chain 100']:.0f}"
    label = "JAX's call of a compiled program: 1 / 300 arrays in and out; 1 / 100 matmuls (us)"
    rows.append(_common.row("GPU", label, f"{arrays}; {kernels}"))
    out.update(workload=workload.describe(), ratio=out[f"m={1 if stages == 1 else 4}"]["ratio"],
               rows=rows)  # fmt: skip
    return out


def _pair(workload: Any, stages: int, m: int, n: int, rounds: int) -> dict[str, Any]:
    """``parallelize_step`` (``stages`` stages, ``m`` microbatches, 1F1B) against ``jax.jit``
    data parallel over the ``n`` GPUs, accumulating the same ``m`` microbatches in its one
    program; interleaved rounds, medians. ``extra_us_per_op``: the step's time beyond
    ``jax.jit``'s, over the ops the runtime dispatches per step (recorded once)."""
    import multimesh_flax as mm
    from benchmarks import _breakdown, _common

    base = _common.build_jit(workload, "data-parallel 8", devices=n, microbatches=m)
    _common.warm(base, 3)
    pipe = _common.build_mpmd(workload, stages, m, "1f1b", devices=n)
    _common.warm(pipe, 3)
    with mm.record_timeline() as timeline:
        pipe.step()
    ops = len(timeline.events)  # fragments and transfers
    issued: tuple[list[float], list[float]] = ([], [])
    pipe_t, base_t = _common.interleaved(
        [lambda: issued[0].append(pipe.step()), lambda: issued[1].append(base.step())], rounds
    )
    ours, theirs = _common.median(pipe_t), _common.median(base_t)
    ours_issue, theirs_issue = _common.median(issued[0]), _common.median(issued[1])
    runtime_cpu, jax_cpu = _breakdown.runtime_cpu_seconds(pipe, rounds)
    base_cpu = _breakdown.host_cpu_seconds(base.step, rounds)
    _common.release(pipe, base)
    return {
        "jax.jit": {"step_s": theirs, "issue_s": theirs_issue, "host_cpu_s": base_cpu},
        "parallelize_step": {
            "step_s": ours,
            "issue_s": ours_issue,
            "runtime_cpu_s": runtime_cpu,
            "inside_jax_calls_cpu_s": jax_cpu,
        },
        "ratio": ours / theirs,
        "ops_per_step": ops,
        "extra_us_per_op": 1e6 * (ours - theirs) / ops,
        "issue_us_per_op": 1e6 * ours_issue / ops,
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
