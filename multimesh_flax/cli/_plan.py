"""``mmflax plan`` and ``mmflax train --plan auto``: the planner on the reference models.

* `plan_model` plans a preset (`multimesh_flax.plan`): the unstaged model profiled once
  (analytic by default, on one device), then every layout of ``devices`` searched; the
  tensor sizes tried are those dividing the heads, MLP width and vocabulary (what
  ``mmflax train --tensor`` accepts); one recomputation policy for all stages unless
  asked (``parallelize_step`` applies one).
* `planned_options` turns the best plan into ``mmflax train`` settings: blocks per stage,
  data, tensor, microbatches, schedule, recomputation.
* `compare` puts the plan's predictions beside what the run measured: the steady step
  time (from the run's tokens per second), parameter bytes per device (placement) and the
  devices' peak bytes in use where the backend reports them (GPUs; the CPU backend does
  not: ``null``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

import multimesh_flax as mm
from models.pipeline import LOGICAL_RULES
from multimesh_flax.cli import _recipe


def _tensor_sizes(config: Any) -> tuple[int, ...]:
    sizes = (config.num_heads, config.num_kv_heads, config.mlp_dim, config.vocab_size)
    return tuple(t for t in (1, 2, 4, 8) if all(s % t == 0 for s in sizes))


def plan_model(
    model: str,
    layers: int | None,
    *,
    devices: int,
    memory: str | None,
    batch_size: int,
    seq_len: int,
    schedules: tuple[str, ...] | None = None,
    microbatches: tuple[int, ...] | None = None,
    recompute: tuple[str, ...] = ("none", "full"),
    per_stage_recompute: bool = False,
    mode: str = "analytic",
    device: str = "cpu",
    top: int = 10,
) -> mm.Plans:
    """The ranked plans of preset ``model`` on ``devices`` devices of ``memory`` each."""
    config = _recipe.run_config(model, layers, None)
    batch = np.zeros((batch_size, seq_len), np.int32)
    return mm.plan(
        _recipe.make_model(config),
        optax.adamw(1e-3),
        batch,
        devices=devices,
        memory_per_device=memory,
        schedules=schedules,
        microbatches=microbatches,
        recompute=tuple(None if r == "none" else r for r in recompute),
        tensor=_tensor_sizes(config),
        per_stage_recompute=per_stage_recompute,
        rules=LOGICAL_RULES,
        mode=mode,
        device=device,
        top=top,
    )


def planned_options(prediction: mm.Prediction) -> dict[str, Any]:
    """The ``mmflax train`` settings of a plan (for `resolve_options`)."""
    applied = prediction.apply()
    mesh = dict(applied.mesh_axes)
    policy = applied.step_kwargs["recompute"]
    return {
        "stages": None,
        "layers_per_stage": applied.layers_per_stage,
        "data": mesh.get("data", 1),
        "tensor": mesh.get("model", 1),
        "microbatches": applied.step_kwargs["microbatches"],
        "schedule": applied.step_kwargs["schedule"],
        "recompute": "none" if policy is None else policy,
    }


def _device_peaks() -> dict[str, int] | None:
    peaks = {}
    for device in jax.local_devices():
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks[str(device.id)] = int(stats["peak_bytes_in_use"])
    return peaks


def compare(prediction: mm.Prediction, metrics: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Predicted against measured step time and memory (`metrics`: the run's)."""
    rate = metrics["summary"]["tokens_per_s"]
    measured_step = tokens / rate if rate else None
    params = {int(d): b for d, b in metrics["placement"]["bytes_per_device"].items()}
    plan = prediction.plan
    per_stage = len(params) // plan.num_stages if params else 0
    measured_params = [
        max(params.get(d, 0) for d in range(s * per_stage, (s + 1) * per_stage))
        for s in range(plan.num_stages)
    ]
    peaks = _device_peaks()
    return {
        "plan": mm.planner._search.describe(plan),
        "predicted_step_s": prediction.step_time,
        "measured_step_s": measured_step,
        "step_time_ratio": measured_step / prediction.step_time if measured_step else None,
        "predicted_peak_bytes_per_stage": list(prediction.peak_bytes),
        "measured_peak_bytes_per_device": peaks,
        "predicted_param_bytes_per_stage": [s.param_bytes for s in prediction.stages],
        "measured_param_bytes_per_stage": measured_params,
        "sources": {k: str(v) for k, v in prediction.sources.items()},
    }


def describe_comparison(c: dict[str, Any]) -> list[str]:
    """Lines for the terminal."""
    measured = "n/a" if c["measured_step_s"] is None else f"{c['measured_step_s'] * 1e3:.1f} ms"
    peaks = c["measured_peak_bytes_per_device"]
    peak = "not reported by this backend" if peaks is None else f"{max(peaks.values()):,} B"
    return [
        f"plan: {c['plan']}",
        f"  step time: predicted {c['predicted_step_s'] * 1e3:.1f} ms "
        f"({c['sources']['unit times']} unit times), measured {measured}",
        f"  peak bytes per device: predicted {max(c['predicted_peak_bytes_per_stage']):,} B, "
        f"measured {peak}",
        f"  parameter bytes per stage: predicted {c['predicted_param_bytes_per_stage']}, "
        f"placed {c['measured_param_bytes_per_stage']}",
    ]
