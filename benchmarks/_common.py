"""Shared pieces of the benchmark suite: workloads, steps, timing, compile counting, rows.

A *workload* is a GPT preset with a batch shape and an optimizer. It is built two ways:

* :func:`build_mpmd` -- ``multimesh_flax.parallelize_step`` of ``GPT(config, stages=S)`` on a
  ``(stage, data, model)`` ``MultiMesh`` of the 8 devices, with ``m`` microbatches and a
  schedule;
* :func:`build_jit` -- what a user would write instead: plain ``jax.jit`` of the unstaged
  ``GPT(config)`` step, parameters and batch sharded over all 8 devices by the models' logical
  names (``flax.linen.logical_to_mesh_sharding``), in one of three layouts (``LAYOUTS``).

Both give a :class:`Runner` whose ``step()`` runs one blocked training step. Timing helpers
alternate the programs they compare, round by round, so the load of a shared host hits both
alike; results are medians and ratios of medians measured in the same process.

Every section returns a JSON-able dict with a ``"rows"`` list of :class:`Row` dicts (metric,
value, target, pass) that ``report.py`` turns into the markdown table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from benchmarks import SMOKE_VAR
from models import GPT, Llama, cross_entropy_loss, get_config
from models.pipeline import LOGICAL_RULES, make_multimesh

DEVICES = 8

# ``python -m benchmarks --smoke`` (the test suite's run): every section's code once, with one
# small pipeline configuration and few rounds; its numbers are not measurements. An
# environment variable, so that the sections' child processes (B3's cold starts, B8's
# processes) see it too.
SMOKE = os.environ.get(SMOKE_VAR) == "1"
SMOKE_CONFIG = (2, 2, "1f1b")  # (stages, microbatches, schedule) every smoke section uses


# --- workloads ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model preset, its overrides, a batch shape and an optimizer.

    ``optimizer`` is ``"adamw"`` or ``"sgd"`` (plain SGD keeps the 8 replicas of a
    data-parallel gpt-small inside a small host's memory).
    """

    preset: str
    batch: int
    length: int
    overrides: tuple[tuple[str, Any], ...] = ()
    optimizer: str = "adamw"
    stage_parallel: str = "data"  # inside a pipeline stage: "data" or "tensor" parallel

    @property
    def name(self) -> str:
        return self.preset

    def config(self) -> Any:
        return get_config(self.preset, **dict(self.overrides))

    def make_optimizer(self) -> optax.GradientTransformation:
        if self.optimizer == "sgd":
            return optax.sgd(1e-3)
        return optax.adamw(1e-3)

    def family(self) -> type[nn.Module]:
        return Llama if self.preset.startswith("llama") else GPT

    def batch_data(self, seed: int = 0) -> dict[str, jax.Array]:
        tokens = jax.random.randint(jax.random.key(seed), (self.batch, self.length + 1), 0, 259)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def describe(self) -> dict[str, Any]:
        cfg = self.config()
        return {
            "preset": self.preset,
            "layers": cfg.num_layers,
            "embed": cfg.embed_dim,
            "vocab": cfg.vocab_size,
            "dtype": jnp.dtype(cfg.dtype).name,
            "batch": self.batch,
            "length": self.length,
            "optimizer": self.optimizer,
            "params": param_count(self),
        }


def param_count(workload: Workload) -> int:
    model = workload.family()(workload.config())
    tokens = jax.ShapeDtypeStruct((1, workload.length), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(nn.unbox(shapes))))


# Tiny: 4 blocks so that 2 and 4 stages both get whole blocks. Small: GPT-2 small's shape
# (12 blocks, width 768, 12 heads) in float32 (the host has no fast bf16), its vocabulary cut
# to 512 ids (byte data needs 259; 512 splits over 8 devices), tensor parallel inside each
# stage (its recorded B1/B3 layouts; data-parallel stages all-reduced every weight
# gradient once per microbatch when they were chosen, which cost more than the step's
# arithmetic at 16 x 32 tokens; since session 31 they all-reduce once a step).
# A smoke run's gpt-tiny has 2 blocks, one per stage of `SMOKE_CONFIG`: the smoke run is mostly
# tracing and compiling, which grow with the blocks (its numbers are not measurements).
TINY_LAYERS = 2 if SMOKE else 4
TINY = Workload("gpt-tiny", batch=32, length=64, overrides=(("num_layers", TINY_LAYERS),))
SMALL = Workload(
    "gpt-small",
    batch=16,
    length=32,
    overrides=(("vocab_size", 512), ("dtype", jnp.float32)),
    optimizer="sgd",
    stage_parallel="tensor",
)


def loss_fn(model_fn: Callable[..., Any], batch: dict[str, jax.Array]) -> jax.Array:
    return cross_entropy_loss(model_fn(batch["inputs"]), batch["targets"])


# --- runners --------------------------------------------------------------------------------


class Runner:
    """One compiled training step and its state: ``step()`` runs it and waits for it."""

    def __init__(self, name: str, call: Callable[[Any, Any], Any], state: Any, batch: Any):
        self.name = name
        self._call = call
        self.state = state
        self.batch = batch
        self.loss: Any = None

    def step(self) -> float:
        """Runs one step and waits for its results; returns the seconds until the call
        returned, before they were ready (the host's issuing, where dispatch is asynchronous:
        an accelerator's devices run behind it)."""
        start = time.perf_counter()
        self.loss, self.state = self._call(self.state, self.batch)
        issued = time.perf_counter() - start
        jax.block_until_ready((self.loss, self.state))
        return issued


class MpmdRunner(Runner):
    """A ``parallelize_step`` training step; ``executable`` is its ``MpmdExecutable``."""

    def __init__(self, name: str, step_fn: Any, state: Any, batch: Any, multi: Any) -> None:
        super().__init__(name, step_fn, state, batch)
        self.step_fn = step_fn
        self.multi = multi
        self._placed = False

    @property
    def executable(self) -> Any:
        return self.step_fn.executable(self.state, self.batch)

    def step(self) -> float:
        issued = super().step()
        if not self._placed:  # the batch in the step's input shardings, as a data loader would
            shardings = self.executable.input_shardings
            leaves, tree = jax.tree_util.tree_flatten(self.batch)
            placed = jax.device_put(leaves, shardings[len(shardings) - len(leaves) :])
            self.batch = jax.tree_util.tree_unflatten(tree, placed)
            self._placed = True
        return issued


def mpmd_name(workload: Workload, stages: int, m: int, schedule: str) -> str:
    return f"{workload.name} S={stages} m={m} {schedule}"


def stage_layout(
    workload: Workload, stages: int, m: int, devices: int = DEVICES
) -> tuple[int, int]:
    """``(data, model)`` inside a stage: data parallel over the stage's devices when every
    microbatch splits evenly over them, else as much tensor parallelism as needed (all
    tensor parallel for ``stage_parallel="tensor"`` workloads)."""
    per_stage = devices // stages
    if workload.stage_parallel == "tensor":
        return 1, per_stage
    data = per_stage
    while data > 1 and (workload.batch // m) % data:
        data //= 2
    return data, per_stage // data


def build_mpmd(
    workload: Workload,
    stages: int,
    m: int,
    schedule: str,
    devices: int = DEVICES,
    **options: Any,
) -> MpmdRunner:
    """``parallelize_step`` of the staged model on the first ``devices`` devices
    (``options``: more of its keyword arguments, e.g. ``recompute``, ``precision``)."""
    data, model = stage_layout(workload, stages, m, devices)
    multi = make_multimesh(stages, data, model, devices=jax.devices()[:devices])
    batch = workload.batch_data()
    built = mm.parallelize_step(
        workload.family()(workload.config(), stages=stages),
        workload.make_optimizer(),
        multi,
        batch,
        loss_fn=loss_fn,
        microbatches=m if m > 1 or stages > 1 else None,
        schedule=schedule if m > 1 or stages > 1 else None,
        **options,
    )
    name = mpmd_name(workload, stages, m, schedule)
    return MpmdRunner(name, built.step, built.state, batch, multi)


LAYOUTS = {
    # name: (mesh shape (data, model), extra leading logical rules)
    "data-parallel 8": ((8, 1), ()),
    "FSDP 8": ((8, 1), (("embed", "data"),)),
    "data 4 x tensor 2": ((4, 2), ()),
    "data 2 x tensor 4": ((2, 4), ()),
}
# A smoke run compares against one layout without and one with a tensor axis.
SMOKE_LAYOUTS = ("data-parallel 8", "data 4 x tensor 2")


def compared_layouts() -> list[str]:
    """The ``jax.jit`` layouts a run times: all of `LAYOUTS`, or `SMOKE_LAYOUTS` when smoke."""
    return list(SMOKE_LAYOUTS if SMOKE else LAYOUTS)


def layout_problem(workload: Workload, layout: str) -> str | None:
    """Why ``layout`` cannot shard ``workload`` evenly, or ``None`` if it can."""
    cfg = workload.config()
    data, model = LAYOUTS[layout][0]
    sizes = {"heads": cfg.num_heads, "mlp": cfg.mlp_dim, "vocab": cfg.vocab_size}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % model]
    if workload.batch % data:
        bad.append(f"batch={workload.batch}")
    if not bad:
        return None
    return f"{', '.join(bad)} do not split over a {data} x {model} mesh"


def layout_rules(layout: str) -> tuple[tuple[str, Any], ...]:
    """The models' logical rules for a baseline layout (FSDP also shards ``embed``)."""
    extra = LAYOUTS[layout][1]
    return (LOGICAL_RULES[0], *extra, *LOGICAL_RULES[1:])


class JitRunner(Runner):
    """Plain ``jax.jit`` of the unstaged model's step, called inside its mesh and rules."""

    def __init__(
        self, name: str, call: Any, state: Any, batch: Any, mesh: Any, rules: Any, layout: str
    ):
        super().__init__(name, call, state, batch)
        self.layout = layout
        self.mesh = mesh
        self.rules = rules
        self.jitted = call

    def context(self) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack

    def step(self) -> float:
        with self.context():
            return super().step()


def _train_step(model: nn.Module, optimizer: Any, microbatches: int = 1) -> Callable[..., Any]:
    def loss_and_grads(params: Any, batch: Any) -> tuple[Any, Any]:
        return jax.value_and_grad(
            lambda p: loss_fn(lambda x: model.apply({"params": p}, x), batch)
        )(params)

    def accumulated(params: Any, batch: Any) -> tuple[Any, Any]:
        """Mean loss and gradients over ``microbatches`` slices of the batch, summed in
        microbatch order by a ``lax.scan`` (its body compiles once, however many slices)."""
        if microbatches == 1:
            return loss_and_grads(params, batch)
        parts = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)

        def add(total: Any, part: Any) -> tuple[Any, None]:
            return jax.tree.map(jnp.add, total, loss_and_grads(params, part)), None

        zero = jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), params))
        total, _ = jax.lax.scan(add, zero, parts)
        return jax.tree.map(lambda x: x / microbatches, total)

    def train(state: Any, batch: Any) -> tuple[Any, Any]:
        params, opt_state = state
        loss, grads = accumulated(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, (optax.apply_updates(params, updates), opt_state)

    return train


def build_jit(
    workload: Workload, layout: str, devices: int = DEVICES, microbatches: int = 1
) -> JitRunner:
    """The baseline: ``jax.jit`` of the whole step on ``devices`` devices in ``layout``
    (its mesh shape scaled to ``devices``, e.g. data parallel over all of them).

    With ``microbatches > 1`` the step accumulates gradients over that many slices of the
    batch inside the one program: what microbatching costs without any pipeline."""
    shape = LAYOUTS[layout][0]
    shape = (shape[0] * devices // DEVICES, shape[1])
    mesh = jax.make_mesh(
        shape,
        ("data", "model"),
        axis_types=(AxisType.Auto,) * 2,
        devices=jax.devices()[:devices],
    )
    rules = layout_rules(layout)
    model = GPT(workload.config())
    optimizer = workload.make_optimizer()
    batch = workload.batch_data()
    abstract = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])
    param_sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)["params"]

    def init() -> Any:
        params = nn.unbox(model.init(jax.random.key(0), batch["inputs"]))["params"]
        return params, optimizer.init(params)

    abstract_state = jax.eval_shape(init)
    opt_sh = _mirror_shardings(abstract_state[1], abstract_state[0], param_sh, mesh)
    state_sh = (param_sh, opt_sh)
    batch_sh = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        state = jax.jit(init, out_shardings=state_sh)()
        jitted = jax.jit(
            _train_step(model, optimizer, microbatches),
            in_shardings=(state_sh, batch_sh),
            out_shardings=(replicated, state_sh),
            donate_argnums=(0,),
        )
    batch = jax.device_put(batch, batch_sh)
    name = f"{workload.name} jit {layout}" + (f" m={microbatches}" if microbatches > 1 else "")
    return JitRunner(name, jitted, state, batch, mesh, rules, layout)


def _mirror_shardings(opt_state: Any, params: Any, param_sh: Any, mesh: Any) -> Any:
    """Optimizer-state leaves shaped like a parameter take its sharding; others replicate."""
    by_path = {}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), sh in zip(flat, jax.tree_util.tree_leaves(param_sh), strict=True):
        by_path[jax.tree_util.keystr(path)] = (leaf.shape, sh)
    replicated = NamedSharding(mesh, P())

    def pick(path: Any, leaf: Any) -> Any:
        text = jax.tree_util.keystr(path)
        for key, (shape, sh) in by_path.items():
            if text.endswith(key) and shape == leaf.shape:
                return sh
        return replicated

    return jax.tree_util.tree_map_with_path(pick, opt_state)


def release(*runners: Runner | None) -> None:
    """Drops runners' arrays now (gpt-small states are gigabytes)."""
    for r in runners:
        if r is not None:
            r.state = r.batch = r.loss = None
    gc.collect()


# --- timing ---------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(fns: Sequence[Callable[[], Any]], rounds: int) -> list[list[float]]:
    """Per function, ``rounds`` timings; each round runs every function once, in an order
    rotated from round to round, so drifting host load hits all of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for k in range(len(fns)):
            i = (k + r) % len(fns)
            times[i].append(timed(fns[i]))
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def warm(runner: Runner, steps: int = 2) -> float:
    """Runs ``steps`` steps (the first compiles); returns the first one's wall time."""
    first = timed(runner.step)
    for _ in range(steps - 1):
        runner.step()
    return first


# --- compile counting -----------------------------------------------------------------------


class _CompileEvents:
    """Counts XLA backend compilations (``jax.monitoring`` duration events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration


_EVENTS: _CompileEvents | None = None


@contextlib.contextmanager
def count_compiles() -> Iterator[dict[str, float]]:
    """``with count_compiles() as c:`` -- ``c["count"]``, ``c["seconds"]`` of XLA compiles."""
    global _EVENTS
    if _EVENTS is None:
        _EVENTS = _CompileEvents()
    out = {"count": 0, "seconds": 0.0}
    count, seconds = _EVENTS.count, _EVENTS.seconds
    try:
        yield out
    finally:
        out["count"] = _EVENTS.count - count
        out["seconds"] = _EVENTS.seconds - seconds


# --- executables ----------------------------------------------------------------------------


def fragment_count(exe: Any) -> int:
    return sum(op.kind == 0 for op in exe.ops)


def transfer_count(exe: Any) -> int:
    return len(exe.ops) - fragment_count(exe)


def replay(exe: Any, leaves: Sequence[Any]) -> list[Any]:
    """The executable's fragments and transfers (their ``state.fns``: executables, and the
    moves a transfer's first call fixed) called by hand, in its order and with its
    frees (dropping each value after its last reader, so buffers go back to XLA at the same
    points), but none of its checks or argument handling: what JAX alone costs for the same
    work. ``leaves`` must already sit in ``exe.input_shardings``."""
    env: list[Any] = [None] * len(exe._slots)
    for slot, value in exe._consts.items():
        env[slot] = value
    for slot, value in zip(exe.input_slots, leaves, strict=True):
        env[slot] = value
    fns = exe.state.fns  # a fragment's executable, or a transfer's move (core/run/_ops.py)
    for index, op in enumerate(exe.ops):
        values = [env[s] for s in op.ins]
        results = fns[index](*values) if op.kind == 0 else fns[index](values)
        for s, r in zip(op.outs, results, strict=True):
            env[s] = r
        for s in op.frees:
            env[s] = None
    return [env[s] for s in exe.output_slots]


# --- rows -----------------------------------------------------------------------------------


def row(
    section: str,
    metric: str,
    value: Any,
    target: str = "",
    passed: bool | None = None,
    unit: str = "",
) -> dict[str, Any]:
    """One line of the report: a metric, its value, the target and whether it was met."""
    return {
        "section": section,
        "metric": metric,
        "value": value,
        "unit": unit,
        "target": target,
        "pass": passed,
    }


def host() -> dict[str, Any]:
    import os

    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "host_cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "load_average": list(os.getloadavg()),
    }


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    r"""The host CPU's name, family, model, stepping, clock and cache as ``/proc/cpuinfo``
    gives them for its first CPU (so runs on different machines of one name can be told
    apart; a cloud's CPUs often all say "Intel(R) Xeon(R) Processor"), else what
    ``platform.processor()`` says.

    >>> import pathlib, tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     info = pathlib.Path(folder, "cpuinfo")
    ...     _ = info.write_text("model name\t: Xeon\ncpu family\t: 6\nmodel\t: 167\n")
    ...     cpu_model(str(info))
    'Xeon (family 6, model 167)'
    """
    import platform

    try:
        with open(cpuinfo) as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return platform.processor() or "unknown"
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in first.splitlines())
    )
    keys = ("cpu family", "model", "stepping", "cpu MHz", "cache size")
    details = ", ".join(f"{k.removeprefix('cpu ')} {fields[k]}" for k in keys if k in fields)
    name = fields.get("model name", platform.processor() or "unknown")
    return f"{name} ({details})" if details else name


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def np_bytes(x: Any) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
