"""B4 memory: bytes per device of parameters and optimizer state, and per fragment.

Per pipelined program (tiny GPT on 2 and 4 stages, GPipe and 1F1B, ``m = 4``; and the tiny
Llama on 2 stages, whose untied output head makes its two stages equally heavy):

* **Parameters per device**, read from the shards of the live state's arrays, must equal
  ``multimesh_flax.layers.get_placement(...).bytes_per_device()`` -- what ``tabulate``
  prints -- exactly. Optimizer state per device is read the same way. Reported: max, min and
  max/min over the devices. GPT's tied token table lives with the stem on stage 0, so its
  stages are unbalanced by design; the target (max/min at most 1.05) applies to balanced
  stages: the Llama program, and GPT's blocks alone.
* **Temporary memory per fragment**: ``compiled.memory_analysis().temp_size_in_bytes`` of
  every distinct fragment executable (max and sum per schedule).
* **Peak live bytes per device** while a step is dispatched: the runtime's values (inputs,
  activations kept for the backward, gradients) counted op by op with its frees, per
  schedule -- where GPipe and 1F1B differ.
* **Recomputation and precision** (``parallelize_step(..., recompute=..., precision=...)``),
  on the first pipelined GPT configuration: the same three measurements for
  ``recompute`` ``None`` / ``"full"`` / ``"dots"``, and parameter, optimizer-state and peak
  bytes per device for ``precision`` ``"fp32"`` / ``"bf16"`` / ``"pure-bf16"``. The
  bfloat16 rows also set the model config's compute ``dtype`` to bfloat16 (the reference
  models fix their compute dtype, which ``precision`` does not override); their parameters
  stay float32 in ``"bf16"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import multimesh_flax as mm
from benchmarks import _common

SECTION = "B4"
TARGET = 1.05
LLAMA = dataclasses.replace(_common.TINY, preset="llama-tiny")


def _itemsize(x: Any) -> int:
    return int(x.dtype.itemsize)  # also for PRNG key arrays (``key<fry>``: 8 bytes)


def device_bytes(tree: Any) -> dict[int, int]:
    """``{device id: bytes}`` of the shards of every array in ``tree``."""
    totals: dict[int, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            nbytes = int(np.prod(shard.data.shape, dtype=np.int64)) * _itemsize(leaf)
            totals[shard.device.id] = totals.get(shard.device.id, 0) + nbytes
    return dict(sorted(totals.items()))


def _spread(per_device: dict[int, int]) -> dict[str, Any]:
    values = list(per_device.values())
    return {
        "max": max(values),
        "min": min(values),
        "max_over_min": max(values) / min(values),
        "per_device": {str(k): v for k, v in per_device.items()},
    }


def _tabulated(runner: _common.MpmdRunner, workload: _common.Workload, stages: int) -> Any:
    model = workload.family()(workload.config(), stages=stages)
    with runner.multi:
        placement = mm.layers.get_placement(model, jax.random.key(0), runner.batch["inputs"])
    return placement


def _sharding_bytes(x: Any) -> dict[int, int]:
    shape = x.sharding.shard_shape(x.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * _itemsize(x)
    return {d.id: nbytes for d in x.sharding.device_set}


def walk(exe: Any, leaves: list[Any]) -> dict[str, Any]:
    """Runs the program op by op like the runtime; returns per-fragment temp memory and the
    peak live bytes per device (inputs, intermediates, frees as the runtime does them), also
    with each fragment's XLA temp memory added on its devices while it runs."""
    env: list[Any] = [None] * len(exe._slots)
    for slot, value in exe._consts.items():
        env[slot] = value
    for slot, value in zip(exe.input_slots, leaves, strict=True):
        env[slot] = value
    live: dict[int, int] = {}

    def add(x: Any, sign: int) -> None:
        for d, n in _sharding_bytes(x).items():
            live[d] = live.get(d, 0) + sign * n

    for x in env:
        if x is not None:
            add(x, 1)
    start = dict(live)
    peak = dict(live)
    peak_with_temp = dict(live)
    temps: dict[str, int] = {}
    temp_of: dict[Any, int] = {}
    for index, op in enumerate(exe.ops):
        values = [env[s] for s in op.ins]
        if op.kind == 0:
            key = (id(op.program), tuple(v.sharding for v in values))
            if key not in temp_of:
                stats = op.program.executable(values).memory_analysis()
                temp_of[key] = temps[op.name] = int(stats.temp_size_in_bytes)
            results = exe.state.fns[index](*values)
        else:
            results = jax.device_put(values, exe.state.put_shardings[index])
        for s, r in zip(op.outs, results, strict=True):
            if env[s] is not None:
                add(env[s], -1)
            env[s] = r
            add(r, 1)
        for d, n in live.items():
            peak[d] = max(peak.get(d, 0), n)
        if op.kind == 0:  # the fragment's scratch, on its devices, while its operands live
            for d in {d.id for r in results for d in r.sharding.device_set}:
                peak_with_temp[d] = max(peak_with_temp.get(d, 0), live[d] + temp_of[key])
        for s in op.frees:
            if env[s] is not None:
                add(env[s], -1)
            env[s] = None
    jax.block_until_ready([env[s] for s in exe.output_slots])
    return {
        "fragment_temp_bytes": temps,
        "max_fragment_temp_bytes": max(temps.values()),
        "sum_fragment_temp_bytes": sum(temps.values()),
        "peak_live_bytes_per_device": {str(k): v for k, v in sorted(peak.items())},
        "peak_above_inputs_per_device": {str(k): peak[k] - start.get(k, 0) for k in sorted(peak)},
        "peak_with_temp_per_device": {str(k): v for k, v in sorted(peak_with_temp.items())},
        "outputs": [env[s] for s in exe.output_slots],
    }


def _blocks_only(runner: _common.MpmdRunner) -> dict[int, int]:
    blocks = {k: v for k, v in runner.state.params.items() if k.startswith("blocks_")}
    return device_bytes(blocks)


def _walk_step(runner: _common.MpmdRunner) -> dict[str, Any]:
    """:func:`walk` over one step of ``runner``, whose state becomes the step's new state."""
    exe = runner.executable
    tree = jax.tree_util.tree_structure(runner.state)
    leaves = [*jax.tree_util.tree_leaves(runner.state), *jax.tree_util.tree_leaves(runner.batch)]
    walked = walk(exe, leaves)
    runner.state = jax.tree_util.tree_unflatten(tree, walked.pop("outputs")[1:])
    walked["forward_outputs"] = sum(
        len(op.outs) for op in exe.ops if op.kind == 0 and ".fwd" in op.name
    )
    return walked


def measure(workload: _common.Workload, stages: int, m: int, schedule: str) -> dict[str, Any]:
    from benchmarks import b1_step_time

    runner, owned = b1_step_time.kept_or_built(workload, stages, m, schedule)
    params = device_bytes(runner.state.params)
    placement = _tabulated(runner, workload, stages).bytes_per_device()
    opt = device_bytes(runner.state.opt_state)
    total = {d: params.get(d, 0) + opt.get(d, 0) for d in sorted(set(params) | set(opt))}
    walked = _walk_step(runner)
    result = {
        "name": runner.name,
        "stages": stages,
        "microbatches": m,
        "schedule": schedule,
        "params": _spread(params),
        "tabulate_params_per_device": {str(k): v for k, v in placement.items()},
        "params_equal_tabulate": params == placement,
        "opt_state": _spread(opt),
        "params_plus_opt_state": _spread(total),
        "blocks_params": _spread(_blocks_only(runner)),
        **walked,
    }
    if owned:
        _common.release(runner)
    return result


def _rows(r: dict[str, Any], preset: str) -> list[dict[str, Any]]:
    label = f"{preset} S={r['stages']} m={r['microbatches']} {r['schedule']}"
    p, o = r["params"], r["opt_state"]
    rows = [
        _common.row(
            SECTION,
            f"{label}: parameter bytes per device == tabulate",
            r["params_equal_tabulate"],
            target="equal",
            passed=r["params_equal_tabulate"],
        ),
        _common.row(
            SECTION,
            f"{label}: parameter bytes per device max / min",
            f"{p['max']:,} / {p['min']:,}",
        ),
        _common.row(
            SECTION,
            f"{label}: optimizer bytes per device max / min",
            f"{o['max']:,} / {o['min']:,}",
        ),
    ]
    balanced = preset.startswith("llama") and r["stages"] == 2
    spread = r["params_plus_opt_state"]["max_over_min"]
    rows.append(
        _common.row(
            SECTION,
            f"{label}: params + optimizer max/min over devices"
            + ("" if balanced else " (tied table on stage 0)"),
            round(spread, 3),
            target=f"<= {TARGET}" if balanced else "",
            passed=spread <= TARGET if balanced else None,
        )
    )
    if not balanced:
        blocks = r["blocks_params"]["max_over_min"]
        rows.append(
            _common.row(
                SECTION,
                f"{label}: blocks' parameters max/min over devices",
                round(blocks, 3),
                target=f"<= {TARGET}",
                passed=blocks <= TARGET,
            )
        )
    peak = max(r["peak_above_inputs_per_device"].values())
    rows += [
        _common.row(
            SECTION,
            f"{label}: largest fragment temp memory",
            r["max_fragment_temp_bytes"],
            unit="B",
        ),
        _common.row(
            SECTION, f"{label}: peak live bytes above the state, per device", peak, unit="B"
        ),
    ]
    return rows


# --- recomputation and precision --------------------------------------------------------------

RECOMPUTE = (None, "full", "dots")
PRECISION = ("fp32", "bf16", "pure-bf16")


def _build(
    workload: _common.Workload, stages: int, m: int, schedule: str, **options: Any
) -> _common.MpmdRunner:
    """``_common.build_mpmd`` with ``parallelize_step`` options (``recompute``,
    ``precision``), warmed by one step."""
    runner = _common.build_mpmd(workload, stages, m, schedule, **options)
    _common.warm(runner, steps=1)
    return runner


def _summary(params: dict[int, int], opt: dict[int, int], walked: dict[str, Any]) -> dict:
    return {
        "params_max": max(params.values()),
        "opt_state_max": max(opt.values()),
        "peak_above_state_max": max(walked["peak_above_inputs_per_device"].values()),
        "peak_with_temp_above_state_max": max(
            walked["peak_with_temp_per_device"][d]
            - (walked["peak_live_bytes_per_device"][d] - walked["peak_above_inputs_per_device"][d])
            for d in walked["peak_with_temp_per_device"]
        ),
        "max_fragment_temp_bytes": walked["max_fragment_temp_bytes"],
        "forward_outputs": walked["forward_outputs"],
        "peak_above_inputs_per_device": walked["peak_above_inputs_per_device"],
    }


def _measure_built(runner: _common.MpmdRunner) -> dict[str, Any]:
    params, opt = device_bytes(runner.state.params), device_bytes(runner.state.opt_state)
    summary = _summary(params, opt, _walk_step(runner))
    _common.release(runner)
    return summary


def _bf16_compute(workload: _common.Workload) -> _common.Workload:
    return dataclasses.replace(workload, overrides=(*workload.overrides, ("dtype", jnp.bfloat16)))


def measure_options(
    workload: _common.Workload, stages: int, m: int, schedule: str, plain: dict[str, Any]
) -> dict[str, Any]:
    """Bytes per device for every ``recompute`` and ``precision`` option; ``plain`` is
    :func:`measure`'s result for the same configuration (no recomputation, float32). Smoke
    runs measure ``"full"`` only."""
    base = _summary({0: plain["params"]["max"]}, {0: plain["opt_state"]["max"]}, plain)
    out: dict[str, Any] = {"recompute": {"None": base}, "precision": {"fp32": base}}
    for policy in RECOMPUTE[1:2] if _common.SMOKE else RECOMPUTE[1:]:
        runner = _build(workload, stages, m, schedule, recompute=policy)
        out["recompute"][policy] = _measure_built(runner)
    for dtype in () if _common.SMOKE else PRECISION[1:]:
        runner = _build(_bf16_compute(workload), stages, m, schedule, precision=dtype)
        out["precision"][dtype] = _measure_built(runner)
    return out


def _ratio_rows(metric: str, value: int, base: int, baseline: str | None) -> list[dict]:
    """``value / base`` as a row (target: below 1); none for the baseline itself."""
    if baseline is None:
        return []
    ratio = round(value / base, 3)
    return [_common.row(SECTION, f"{metric} / {baseline}", ratio, target="< 1", passed=ratio < 1)]


def _option_rows(options: dict[str, Any], label: str) -> list[dict[str, Any]]:
    """Rows per recomputation policy and per precision: bytes per device (maxima over the
    devices) and their ratios to the plain float32 program."""
    rows = []
    base = options["recompute"]["None"]
    for policy, r in options["recompute"].items():
        name = f"{label} recompute={policy}"
        baseline = None if policy == "None" else "recompute=None"
        peak, temp = r["peak_above_state_max"], r["peak_with_temp_above_state_max"]
        rows += [
            _common.row(SECTION, f"{name}: peak live bytes above the state, per device", peak,
                        unit="B"),
            *_ratio_rows(f"{name}: peak live bytes", peak, base["peak_above_state_max"],
                         baseline),
            _common.row(SECTION, f"{name}: peak with the running fragment's temp memory, "
                        "above the state", temp, unit="B"),
            *_ratio_rows(f"{name}: peak with temp", temp, base["peak_with_temp_above_state_max"],
                         baseline),
            _common.row(SECTION, f"{name}: values the forward fragments hand on",
                        r["forward_outputs"]),
        ]  # fmt: skip
    for dtype, r in options["precision"].items():
        name = f"{label} precision={dtype}"
        baseline = None if dtype == "fp32" else "fp32"
        peak = r["peak_above_state_max"]
        rows += [
            _common.row(SECTION, f"{name}: parameter / optimizer bytes per device (max)",
                        f"{r['params_max']:,} / {r['opt_state_max']:,}"),
            _common.row(SECTION, f"{name}: peak live bytes above the state, per device", peak,
                        unit="B"),
            *_ratio_rows(f"{name}: peak live bytes", peak, base["peak_above_state_max"],
                         baseline),
        ]  # fmt: skip
    return rows


def run(quick: bool) -> dict[str, Any]:
    configs = [(_common.TINY, 2, 4, "1f1b"), (LLAMA, 2, 4, "1f1b")]
    if _common.SMOKE:
        configs = [(_common.TINY, *_common.SMOKE_CONFIG)]
    elif not quick:
        configs += [
            (_common.TINY, 2, 4, "gpipe"),
            (_common.TINY, 4, 4, "gpipe"),
            (_common.TINY, 4, 4, "1f1b"),
        ]
    results, rows = [], []
    for workload, s, m, sched in configs:
        r = measure(workload, s, m, sched)
        r["workload"] = workload.describe()
        results.append(r)
        rows += _rows(r, workload.preset)
    workload, s, m, sched = configs[0]
    options = measure_options(workload, s, m, sched, results[0])
    options["config"] = {"preset": workload.preset, "stages": s, "microbatches": m,
                         "schedule": sched}  # fmt: skip
    rows += _option_rows(options, f"{workload.preset} S={s} m={m} {sched}")
    return {
        "description": __doc__.splitlines()[0],
        "configs": results,
        "memory_options": options,
        "rows": rows,
    }
