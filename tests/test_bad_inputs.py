"""The bad-input catalogue: user mistakes, the error each one raises, and what it leaves behind.

Every entry of ``CATALOGUE`` is one mistake a user can make with the public API or the
``mmflax`` command line. For each, the test checks

* the class: exactly ``error`` from ``multimesh_flax.errors`` (a ``MultiMeshError`` that is a
  ``ValueError`` or ``TypeError``); command-line mistakes exit with status 2 instead;
* the message: it contains every one of ``fragments`` -- the offending value and the fix;
* that nothing is left half-changed: compiler switches, the current ``MultiMesh`` and device
  list, the task and trace stacks, the active contexts and their registrations, Flax's logical
  rules and JAX's abstract mesh, the recording timeline and every file under the test's
  folder (checkpoints included) are as before; the same mistake made again raises the same
  message; a compiled MPMD program keeps working without recompiling, and where the mistake
  hit a live object (a compiled step, a jitted function) ``after`` checks that a valid call
  on that object still succeeds.

``docs/errors.md`` lists the catalogue; ``test_docs_list_the_catalogue`` keeps it in sync.
After changing the catalogue, regenerate the table with ``python tests/test_bad_inputs.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax._src import source_info_util
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm
from multimesh_flax import checkpoint, errors
from multimesh_flax.core.declare import _config, _registry, _thread
from multimesh_flax.layers import _task as _flax_task

DOCS = Path(__file__).resolve().parent.parent / "docs" / "errors.md"
START, END = "<!-- catalogue:start -->", "<!-- catalogue:end -->"


class CommandLineExit(Exception):
    """``mmflax`` returned status 2; the message is what it printed to stderr."""


@dataclasses.dataclass(frozen=True)
class Mistake:
    """One user mistake and what must come of it."""

    id: str
    area: str
    mistake: str  # what the user did (for the docs)
    call: Callable[[Env], Any]  # makes the mistake; must raise
    error: type[Exception]
    fragments: tuple[str, ...]  # the offending value and the fix, as the message says them
    fix: str  # what the message tells the user to do (for the docs)
    after: Callable[[Env], Any] | None = None  # a valid call that must still work


# --- the world the mistakes are made in -----------------------------------------------------


class _Net(nn.Module):
    """Two Dense layers as tasks on devices [0, 1] and [2, 3]; the output is the loss."""

    @nn.compact
    def __call__(self, x):
        x = mm.layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[0, 1]))(4)(x)
        x = mm.layers.task(nn.Dense, mesh=mm.TaskMesh(devices=[2, 3]))(1)(x)
        return (x**2).mean()


class _Vector(nn.Module):
    """A model whose output is not a scalar."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x)


class _SliceNet(nn.Module):
    """A Dense task on ``mesh_slice={"stage": 0}``: needs a MultiMesh."""

    @nn.compact
    def __call__(self, x):
        return (mm.layers.task(nn.Dense, mesh_slice={"stage": 0})(1)(x) ** 2).mean()


class _BadRules(nn.Module):
    """A Dense task whose rule names mesh axis ``y`` on a mesh with axis ``x`` only."""

    @nn.compact
    def __call__(self, x):
        mesh = mm.TaskMesh(devices=[0, 1], axis_names=("x",))
        dense = mm.layers.task(nn.Dense, mesh=mesh, logical_axes=[("embed", "y")])
        return dense(2, kernel_init=mm.shard_axes(None, "embed"))(x)


def _chain(devices=(0, 1), **microbatch):
    """A two-task loss ``(ws, x) -> scalar`` with tasks ``first``/``second`` on two devices."""
    first = mm.task(lambda w, x: jnp.tanh(x @ w), name="first", mesh=mm.TaskMesh(devices=[0]))
    second = mm.task(lambda w, x: x @ w, name="second", mesh=mm.TaskMesh(devices=[1]))

    def loss(ws, x):
        return jnp.mean(second(ws[1], first(ws[0], x)) ** 2)

    return mm.microbatch(loss, 0, 2, argnum=1, **microbatch) if microbatch else loss


def _double(x):
    return 2 * x


def _scoped_head(x):
    with jax.named_scope("head"):
        return x * 2


class Env:
    """What the mistakes act on: a MultiMesh, a registry, a checkpoint, compiled programs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.x = jnp.ones((8, 4))
        self.ws = [jnp.ones((4, 4)) / 4, jnp.ones((4, 1))]
        self.ckpt = root / "ckpt"
        self.saved = {"step": 1, "w": jnp.arange(4.0)}
        checkpoint.save_checkpoint(self.ckpt, 1, self.saved, metadata={"lr": 0.1})
        self.file = root / "notes.txt"
        self.file.write_text("not a checkpoint directory\n")
        self.cli_dir = root / "cli"
        self.cli_dir.mkdir()
        self.multi = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
        self.context = mm.Context()
        self.context.register_task("head", task=mm.Task(mesh=mm.TaskMesh(devices=[1])))
        # An MPMD program compiled before any mistake: it must keep working, uncompiled.
        self.canary = mm.jit(jax.value_and_grad(_chain()))
        self.canary_value = self._canary()
        self.pipelined = mm.jit(jax.grad(_chain(schedule="1f1b", reduce="mean")))
        self.pipelined(self.ws, self.x)
        self.static = mm.jit(lambda x, names: x * len(names), static_argnums=1)
        self.static(self.x, ("a", "b"))
        self.step, self.state, _ = mm.parallelize_step(
            _Net(), optax.sgd(0.1), global_batch=self.x, microbatches=2, schedule="1f1b"
        )
        self.check_step()
        self.state_ckpt = root / "state_ckpt"  # the train state, to restore without a target
        checkpoint.save_checkpoint(self.state_ckpt, 0, self.state)

    def _canary(self) -> np.ndarray:
        value, grads = self.canary(self.ws, self.x)
        return np.asarray(jax.tree.leaves((value, grads))[0])

    def check_canary(self) -> None:
        np.testing.assert_array_equal(self._canary(), self.canary_value)
        assert self.canary.cache_size() == 1  # nothing recompiled, nothing half-cached

    def check_step(self) -> None:
        """The donated state survived the mistake: a valid step runs on it."""
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.state))
        loss, self.state = self.step(self.state, self.x)
        assert np.isfinite(float(loss))
        assert self.step.jitted.cache_size() == 1

    def check_pipelined(self) -> None:
        grads = self.pipelined(self.ws, self.x)
        assert all(np.isfinite(np.asarray(g)).all() for g in grads)
        assert self.pipelined.cache_size() == 1

    def check_static(self) -> None:
        np.testing.assert_array_equal(self.static(self.x, ("a", "b")), 2 * np.ones((8, 4)))
        assert self.static.cache_size() == 1


@contextlib.contextmanager
def _cwd(path: Path):
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def _cli(env: Env, *argv: str) -> None:
    """Runs ``mmflax argv`` (in an empty folder); status 2 raises ``CommandLineExit``."""
    from multimesh_flax.cli import _cli as cli

    err, out = io.StringIO(), io.StringIO()
    with _cwd(env.cli_dir), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = cli.main(list(argv))
    assert status == 2, (status, err.getvalue(), out.getvalue())
    assert "Traceback" not in err.getvalue()
    raise CommandLineExit(err.getvalue().strip())


def _in(context: Any, fun: Callable[[], Any]) -> Any:
    with context:
        return fun()


# --- the catalogue --------------------------------------------------------------------------

M = Mistake
TM = mm.TaskMesh
E = errors


def _key():
    return jax.random.key(0)


def _custom(*rows):
    return mm.make_schedule("custom", 2, 1, custom=[list(r) for r in rows])


def _save(env, step, state=None, **kw):
    checkpoint.save_checkpoint(env.ckpt, step, env.saved if state is None else state, **kw)


def _damaged_ckpt(env, kind):
    """A checkpoint beside the test folder, changed after the save: 64 data bytes flipped
    (`bytes`) or its metadata file overwritten (`json`). Made once, then reused."""
    path = env.root.parent / f"{env.root.name}-damaged-{kind}"
    if not path.exists():
        w = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
        checkpoint.save_checkpoint(path, 1, {"w": jnp.asarray(w)}, metadata={"lr": 0.1})
        if kind == "json":
            (path / "1" / "metadata" / "metadata").write_bytes(b"\xff not json")
        else:
            data = max((path / "1" / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64 * [0xFF])
            data.write_bytes(bytes(raw))
    return path


def _reshard_on_auto_axes(env):
    with env.multi:
        body = mm.task(lambda x: jax.sharding.reshard(x, P("data")), mesh_slice={"stage": 0})
        return mm.jit(body)(env.x)


# fmt: off
CATALOGUE: list[Mistake] = [
    # --- meshes ---
    M("mesh-names-sizes", "meshes", "`MultiMesh` with 2 axis sizes but 1 axis name",
      lambda env: mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage",)),
      E.MeshShapeError, ("(2, 4)", "('stage',)", "as many names as sizes"),
      "pass one name per axis size"),
    M("mesh-device-count", "meshes", "axis sizes whose product is not the device count",
      lambda env: mm.MultiMesh(axis_sizes=(3, 3), axis_names=("a", "b")),
      E.MeshShapeError, ("Expected 9 devices", "got 8", "Change the sizes"),
      "change the sizes or the devices so the product matches"),
    M("mesh-int-sizes", "meshes", "`axis_sizes=8` (an int, not a tuple)",
      lambda env: mm.MultiMesh(axis_sizes=8, axis_names=("x",)),
      E.MeshShapeError, ("got int: 8", "e.g. (8,)"), "write a tuple such as `(8,)`"),
    M("mesh-string-names", "meshes", "`axis_names=\"data\"` (a string, not a tuple)",
      lambda env: mm.MultiMesh(axis_sizes=(8,), axis_names="data"),
      E.MeshShapeError, ("got str: 'data'", "Write a tuple"), "write a tuple such as `('x',)`"),
    M("mesh-duplicate-names", "meshes", "the same axis name twice",
      lambda env: mm.MultiMesh(axis_sizes=(2, 4), axis_names=("x", "x")),
      E.MeshShapeError, ("distinct mesh axis names", "('x', 'x')", "Name every axis once"),
      "name every axis once"),
    M("mesh-duplicate-devices", "meshes", "one device listed twice",
      lambda env: mm.MultiMesh(axis_sizes=(2,), axis_names=("x",),
                               devices=[jax.devices()[0]] * 2),
      E.DuplicateDeviceError, ("CpuDevice(id=0) more than once", "List each one once"),
      "list each device once"),
    M("jit-donate-static", "jit/parallelize", "one argument in both `static_argnums` and "
      "`donate_argnums`",
      lambda env: mm.jit(lambda x, n: x * n, static_argnums=1, donate_argnums=1),
      E.DonationError, ("Argument 1", "`static_argnums`=(1,)", "remove it from `donate_argnums`"),
      "stop donating the static argument"),
    M("jit-donate-beyond", "jit/parallelize", "a donated argnum beyond the call's arguments",
      lambda env: mm.jit(lambda x: x * 2, donate_argnums=1)(env.x),
      E.DonationError, ("`donate_argnums`=(1,)", "1 positional arguments", "fix `donate_argnums`"),
      "donate only arguments the call passes"),
    M("jit-donate-aliased", "jit/parallelize", "`f(x, x)` with argument 0 donated (one array "
      "consumed and read)", lambda env: _donate_aliased(env),
      E.DonationError, ("float32[8, 4]", "`args[0]` and as `args[1]`", "`jnp.copy(x)`"),
      "pass a copy in one place, or donate less"),
    M("mesh-nothing", "meshes", "`MultiMesh()` with no arguments and no `jax.set_mesh` mesh",
      lambda env: mm.MultiMesh(),
      E.MeshShapeError, ("got neither", "under `jax.set_mesh(mesh)`"),
      "pass sizes and names, or call it under `jax.set_mesh`"),
    M("mesh-axis-types", "meshes", "two axis types for a one-axis mesh",
      lambda env: mm.MultiMesh(axis_sizes=(8,), axis_names=("x",),
                               axis_types=(AxisType.Explicit,) * 2),
      E.MeshShapeError, ("one jax.sharding.AxisType per axis of ('x',)", "(AxisType.Explicit,)"),
      "pass one `AxisType` per axis"),
    M("mesh-global-and-sizes", "meshes", "both `global_mesh` and `axis_sizes`",
      lambda env: mm.MultiMesh(global_mesh=env.multi.mesh, axis_sizes=(8,)),
      E.MeshShapeError, ("got both", "Pass only `global_mesh`"), "pass only one of them"),
    M("slice-unknown-axis", "meshes", "`MultiMesh.slice` along an axis the mesh lacks",
      lambda env: env.multi.slice(pipe=0),
      E.UnknownMeshAxisError, ("'pipe'", "('stage', 'data')", "Slice along one of those"),
      "slice along one of the mesh's axes"),
    M("slice-index-range", "meshes", "`MultiMesh.slice(stage=5)` on a 2-stage mesh",
      lambda env: env.multi.slice(stage=5),
      E.MeshIndexError, ("stage=5", "size 2", "[0, 2)"), "use an index in `[0, size)`"),
    M("taskmesh-devices", "meshes", "`TaskMesh(devices=jax.devices()[:2])` (devices, not "
      "positions)", lambda env: TM(devices=jax.devices()[:2]),
      E.DevicePositionError, ("CpuDevice(id=0)", "integer positions", "jax.sharding.Mesh"),
      "pass positions `0..N-1`, or a `jax.sharding.Mesh` as `mesh=`"),
    M("taskmesh-negative", "meshes", "a negative device position",
      lambda env: TM(devices=[-1]),
      E.MeshIndexError, ("[-1]", "positions >= 0", "positions 0..N-1"), "use positions `>= 0`"),
    M("taskmesh-duplicate", "meshes", "a device position listed twice",
      lambda env: TM(devices=[0, 0]),
      E.DuplicateDeviceError, ("0 more than once", "List each one once"),
      "list each position once"),
    M("taskmesh-count", "meshes", "a `TaskMesh` with 3 positions for axis sizes (2, 2)",
      lambda env: TM(devices=[0, 1, 2], axis_sizes=(2, 2)),
      E.MeshShapeError, ("Expected 4 device positions", "got 3"),
      "give as many positions as the product of the sizes"),
    M("taskmesh-beyond-devices", "meshes", "a `TaskMesh` position beyond `jit(devices=...)`",
      lambda env: mm.jit(mm.task(lambda x: x + 1, mesh=TM(devices=[3])),
                         devices=jax.devices()[:2])(env.x),
      E.MeshIndexError, ("position 3", "2 devices", "positions below 2"),
      "use positions below the device count, or pass more `devices`"),
    M("slice-without-multimesh", "meshes", "`slice_global_mesh` outside `with multi_mesh:`",
      lambda env: mm.slice_global_mesh(stage=0),
      E.NoMultiMeshError, ("{'stage': 0}", "inside `with multi_mesh:`"),
      "call it inside `with multi_mesh:`"),
    M("mesh-slice-without-multimesh", "meshes", "a `mesh_slice` task traced with no MultiMesh",
      lambda env: mm.jit(mm.task(lambda x: x, name="stem", mesh_slice={"stage": 0}))(env.x),
      E.NoMultiMeshError, ("'stem'", "{'stage': 0}", "`with multi_mesh:`"),
      "trace it inside `with multi_mesh:`, or give it a `mesh`"),
    M("mesh-slice-index-range", "meshes", "a task on `mesh_slice={'stage': 2}` of 2 stages",
      lambda env: _in(env.multi, lambda: mm.jit(
          mm.task(lambda x: x, mesh_slice={"stage": 2}))(env.x)),
      E.MeshIndexError, ("stage=2", "[0, 2)"), "use an index in `[0, size)`"),
    # --- tasks ---
    M("task-mesh-and-slice", "tasks", "a `Task` with both `mesh` and `mesh_slice`",
      lambda env: mm.Task(mesh=TM(devices=[0]), mesh_slice={"stage": 0}),
      E.InvalidTaskError, ("got both", "{'stage': 0}", "drop one"), "drop one of them"),
    M("task-mesh-type", "tasks", "`Task(mesh=[0, 1])` (a list, not a mesh)",
      lambda env: mm.Task(mesh=[0, 1]),
      E.TaskTypeError, ("list: [0, 1]", "`TaskMesh(devices=[0, 1])`"),
      "pass a `TaskMesh` or `jax.sharding.Mesh`"),
    M("task-not-a-task", "tasks", "`task(fun, task='stage0')` (a string, not a Task)",
      lambda env: mm.task(lambda x: x, task="stage0"),
      E.TaskTypeError, ("str: 'stage0'", "Build one with `Task("),
      "build a `Task(...)` or pass its options as keywords"),
    M("task-and-options", "tasks", "both `task=` and task options",
      lambda env: mm.task(lambda x: x, task=mm.Task(), mesh=TM(devices=[0])),
      E.InvalidTaskError, ("['mesh']", "Put the options into the Task"),
      "put the options into the `Task`"),
    M("task-unknown-option", "tasks", "a misspelt task option (`meshes=`)",
      lambda env: mm.task(lambda x: x, meshes=TM(devices=[0])),
      E.InvalidTaskError, ("'meshes'", "expected one of", "'mesh'"),
      "use one of the listed `Task` fields"),
    M("task-name-type", "tasks", "`Task(name=3)`",
      lambda env: mm.Task(name=3),
      E.InvalidTaskError, ("int: 3", "name='3'"), "pass a string name"),
    M("task-mesh-slice-type", "tasks", "`Task(mesh_slice='stage0')` (not a mapping)",
      lambda env: mm.Task(mesh_slice="stage0"),
      E.InvalidTaskError, ("str: 'stage0'", "mesh_slice={'stage': 0}"),
      "pass a mapping `{axis: index}`"),
    M("task-split-backprop", "tasks", "`split_backprop` with one name instead of two",
      lambda env: mm.Task(split_backprop=("act",)),
      E.InvalidTaskError, ("('act',)", "two name suffixes", "Pass two strings"),
      "pass two suffixes"),
    M("task-mesh-and-devices", "tasks", "both `mesh` and `devices`",
      lambda env: mm.task(lambda x: x, mesh=TM(devices=[0]), devices=jax.devices()[:1]),
      E.InvalidTaskError, ("`mesh` or `devices`", "got both", "Pass one of them"),
      "pass one of them"),
    M("task-device-axes", "tasks", "`device_axes` with 2 names for a 1-D device list",
      lambda env: mm.task(lambda x: x, devices=jax.devices()[:2], device_axes=("x", "y")),
      E.MeshShapeError, ("shape (2,)", "('x', 'y')", "one name per axis"),
      "give one name per axis of `devices`"),
    M("task-recompute-name", "tasks", "`task(fun, recompute='all')` (a misspelt policy)",
      lambda env: mm.task(lambda x: x, mesh=TM(devices=[0]), recompute="all"),
      E.RecomputePolicyError, ("str: 'all'", "'dots'", "jax.checkpoint_policies"),
      "pass `None`, `False`/`'none'`, `True`/`'full'`, `'dots'` or a checkpoint policy"),
    M("task-recompute-type", "tasks", "`task(nn.Dense, recompute=1.5)` (not a policy)",
      lambda env: mm.task(nn.Dense, mesh=TM(devices=[0]), recompute=1.5),
      E.RecomputePolicyError, ("float: 1.5", "`recompute='full'`"),
      "pass a policy name or a checkpoint policy"),
    M("task-not-callable", "tasks", "`task(3, ...)` (not a function)",
      lambda env: mm.task(3, mesh=TM(devices=[0])),
      E.TaskTypeError, ("int: 3", "Pass the function itself"), "pass a function"),
    M("task-module-instance", "tasks", "`mm.task(nn.Dense(4), ...)` (an instance)",
      lambda env: mm.task(nn.Dense(4), mesh=TM(devices=[0])),
      E.TaskTypeError, ("instance of Dense", "Pass the class"),
      "pass the class: `mm.task(nn.Dense, ...)(4)`"),
    M("task-in-scan", "tasks", "a task called inside `lax.scan`",
      lambda env: mm.jit(lambda x: jax.lax.scan(
          lambda c, _: (mm.task(lambda y: y * 2, name="double", mesh=TM(devices=[1]))(c), None),
          x, None, length=2)[0])(env.x),
      E.TaskInControlFlowError, ("'double'", "`scan`", "Unroll the loop"),
      "unroll the loop in Python, or make the whole loop one task"),
    M("task-in-cond", "tasks", "a task called inside `lax.cond`",
      lambda env: mm.jit(lambda x: jax.lax.cond(
          x.sum() > 0, mm.task(lambda y: y * 2, name="double", mesh=TM(devices=[1])),
          lambda y: y, x))(env.x),
      E.TaskInControlFlowError, ("'double'", "`cond`", "make the whole loop one task"),
      "move the task out of the conditional"),
    # --- logical rules ---
    M("rules-malformed", "logical rules", "`logical_axes=['batch']` (names, not pairs)",
      lambda env: mm.Task(logical_axes=["batch"]),
      E.LogicalRulesError, ("['batch']", "(logical_name, mesh_axis) pairs", "Example"),
      "pass `(logical_name, mesh_axis)` pairs"),
    M("rules-mesh-axis-type", "logical rules", "a rule mapping onto `3` (not an axis name)",
      lambda env: mm.Task(logical_axes=[("batch", 3)]),
      E.LogicalRulesError, ("('batch', 3)", "pairs"), "map onto a mesh axis name or `None`"),
    M("rules-unknown-axis", "logical rules", "a rule naming an axis the task mesh lacks",
      lambda env: mm.jit(mm.task(lambda x: mm.with_sharding_constraint(x, P("batch")),
                                 name="body", mesh=TM(devices=[0, 1], axis_names=("x",)),
                                 logical_axes=[("batch", "y")]))(env.x),
      E.LogicalRulesError, ("('batch', 'y')", "'body'", "axes ('x',)", "Map logical names"),
      "map logical names onto the task mesh's axes"),
    M("reshard-auto-axes", "logical rules", "`jax.sharding.reshard` inside a task on a "
      "`MultiMesh` with Auto axes", lambda env: _reshard_on_auto_axes(env),
      E.AxisTypeError, ("'stage': 1, 'data': 4", "(Auto, Auto)", "Give the mesh Explicit axes"),
      "build the mesh with Explicit axes, or use logical constraints"),
    M("spec-uneven", "logical rules", "a dimension of 6 sharded over 4 devices",
      lambda env: mm.jit(mm.task(lambda x: mm.with_sharding_constraint(x, P("batch")),
                                 mesh=TM(devices=range(4), axis_names=("x",)),
                                 logical_axes=[("batch", "x")]))(jnp.ones((6, 2))),
      E.UnevenShardingError, ("size 6", "4 shards", "Pad it to a multiple of 4"),
      "pad the dimension, or map it to a smaller axis"),
    M("spec-too-long", "logical rules", "a 3-entry spec for a 2-D array",
      lambda env: mm.logical_to_mesh_spec(P("a", "b", "c"), (4, 4), {"x": 2}, []),
      E.PartitionSpecError, ("(4, 4)", "P('a', 'b', 'c')", "Drop the extra entries"),
      "give at most `ndim` entries"),
    M("spec-tuple", "logical rules", "`with_sharding_constraint(x, ('batch',))` in a task",
      lambda env: mm.jit(mm.task(lambda x: mm.with_sharding_constraint(x, ("batch",)),
                                 mesh=TM(devices=[0, 1], axis_names=("x",)),
                                 logical_axes=[("batch", "x")]))(env.x),
      E.PartitionSpecError, ("('batch',)", "str: 'batch'", "P('batch', None)"),
      "write a `PartitionSpec`: `P('batch', None)`"),
    M("spec-string", "logical rules", "`logical_to_mesh_spec('batch', ...)` (a string)",
      lambda env: mm.logical_to_mesh_spec("batch", (8,), {"x": 8}, [("batch", "x")]),
      E.PartitionSpecError, ("str: 'batch'", "P('batch')"), "wrap the name in `P(...)`"),
    M("spec-rules-malformed", "logical rules", "`logical_to_mesh_spec` with 1-tuples as rules",
      lambda env: mm.logical_to_mesh_spec(P("batch"), (8,), {"x": 8}, [("batch",)]),
      E.LogicalRulesError, ("`rules`", "[('batch',)]", "pairs"),
      "pass `(logical_name, mesh_axis)` pairs"),
    M("spec-rules-unknown-axis", "logical rules", "a rule naming an axis `mesh_shape` lacks",
      lambda env: mm.logical_to_mesh_spec(P("batch"), (8,), {"x": 8}, [("batch", "y")]),
      E.LogicalRulesError, ("'y'", "axes ('x',)", "Map logical names"),
      "map logical names onto the mesh's axes"),
    # --- registration ---
    M("register-bad-regex", "registration", "an invalid regex as matcher",
      lambda env: _in(env.context, lambda: mm.register_task("layer_(", task=mm.Task())),
      E.InvalidMatcherError, ("'layer_('", "re.escape"), "fix the pattern or `re.escape` it"),
    M("register-nothing", "registration", "neither a matcher nor `module_class`",
      lambda env: _in(env.context, lambda: mm.register_task(task=mm.Task())),
      E.InvalidMatcherError, ("or a `module_class`", "got neither"),
      "pass a matcher or a module class"),
    M("register-class-instance", "registration", "`module_class=` given a module instance",
      lambda env: _in(env.context, lambda: mm.register_task(module_class=nn.Dense(3),
                                                            task=mm.Task())),
      E.TaskTypeError, ("got Dense", "Pass the class itself"), "pass the class, not an instance"),
    M("register-matcher-type", "registration", "a matcher that is not a string",
      lambda env: _in(env.context, lambda: mm.register_task(3, task=mm.Task())),
      E.InvalidMatcherError, ("int: 3", "regex string"), "pass a regex string"),
    M("register-neither", "registration", "neither `callback` nor `task`",
      lambda env: _in(env.context, lambda: mm.register_task("head")),
      E.TaskRegistrationError, ("'head'", "got neither", "`task=Task(...)`"),
      "pass exactly one of `task=` and `callback=`"),
    M("register-both", "registration", "both `callback` and `task`",
      lambda env: _in(env.context, lambda: mm.register_task(
          "head", callback=lambda n, b: mm.Task(), task=mm.Task())),
      E.TaskRegistrationError, ("got both", "`callback=fn`"),
      "pass exactly one of `task=` and `callback=`"),
    M("register-callback-type", "registration", "a callback that is not callable",
      lambda env: env.context.register_task("head", callback="stage0"),
      E.TaskCallbackError, ("str: 'stage0'", "(matched_name, backprop) -> Task", "Pass a function"),
      "pass a function `(matched_name, backprop) -> Task`"),
    M("register-task-type", "registration", "`task=` that is not a Task",
      lambda env: env.context.register_task("head", task={"stage": 0}),
      E.TaskTypeError, ("dict: {'stage': 0}", "Pass `task=Task(...)`"), "pass a `Task`"),
    M("register-callback-result", "registration", "a callback that returns a string",
      lambda env: _in(_context_with("head", callback=lambda name, backprop: "stage0"),
                      lambda: mm.jit(_scoped_head)(env.x)),
      E.TaskCallbackError, ("'head'", "str: 'stage0'", "Return e.g. `Task("),
      "return a `Task` from the callback"),
    M("register-slice-axis", "registration", "`MultiMesh.register_task` with an unknown axis",
      lambda env: env.multi.register_task("head", task=mm.Task(mesh_slice={"pipe": 0})),
      E.UnknownMeshAxisError, ("'pipe'", "('stage', 'data')"),
      "slice along one of the mesh's axes"),
    M("register-slice-index", "registration", "`MultiMesh.register_task` with index 2 of 2",
      lambda env: env.multi.register_task("head", task=mm.Task(mesh_slice={"stage": 2})),
      E.MeshIndexError, ("stage=2", "[0, 2)"), "use an index in `[0, size)`"),
    # --- microbatching ---
    M("microbatch-uneven", "microbatching", "`size=2` for a batch of 5",
      lambda env: env.pipelined(env.ws, env.x[:5]),
      E.UnevenMicrobatchError, ("`size`=2", "length 5", "pad or trim the batch"),
      "use a size that divides the batch, or pad or trim it",
      after=lambda env: env.check_pipelined()),
    M("microbatch-leaf-lengths", "microbatching", "split leaves of different lengths",
      lambda env: mm.microbatch(lambda b: b[0].sum() + b[1].sum(), 0, 2)(
          (jnp.ones(4), jnp.ones(6))),
      E.UnevenMicrobatchError, ("'[0]': 4", "'[1]': 6", "one batch size only"),
      "split arguments of one batch size only"),
    M("microbatch-dim", "microbatching", "`dim=2` for a 2-D batch",
      lambda env: mm.microbatch(lambda x: x.sum(), 2, 2)(env.x),
      E.MicrobatchAxisError, ("`dim`=2", "shape (8, 4)", "[-2, 2)"),
      "use an axis of every leaf, or split another argument"),
    M("microbatch-argnum", "microbatching", "`argnum=2` for a call with 2 arguments",
      lambda env: mm.microbatch(lambda w, x: x.sum(), 0, 2, argnum=2)(env.ws, env.x),
      E.MicrobatchAxisError, ("`argnum`=2", "2 positional argument(s)", "positionally"),
      "name a positional argument"),
    M("microbatch-negative-argnum", "microbatching", "`argnum=-1`",
      lambda env: mm.microbatch(lambda x: x, 0, 2, argnum=-1),
      E.MicrobatchAxisError, ("got -1", "Count positional arguments from 0"),
      "pass a non-negative index"),
    M("microbatch-reduce", "microbatching", "`reduce='max'`",
      lambda env: mm.microbatch(lambda x: x, 0, 2, reduce="max"),
      E.MicrobatchArgumentError, ("'max'", "['sum', 'mean']", "Use 'mean'"), "use 'sum' or 'mean'"),
    M("microbatch-size", "microbatching", "`size=0`",
      lambda env: mm.microbatch(lambda x: x, 0, 0),
      E.MicrobatchArgumentError, ("`size`", "got 0", "Pass an int >= 1"),
      "pass a positive size"),
    M("microbatch-fun", "microbatching", "a function that is not callable",
      lambda env: mm.microbatch("loss", 0, 2),
      E.MicrobatchArgumentError, ("`fun`", "str: 'loss'", "Pass the function"), "pass a function"),
    # --- schedules ---
    M("schedule-unknown", "schedules", "`microbatch(..., schedule='1F1B')` (wrong case)",
      lambda env: mm.microbatch(lambda x: x, 0, 2, schedule="1F1B"),
      E.InvalidScheduleError, ("'1F1B'", "'1f1b'", "Use one of"), "use one of the names"),
    M("schedule-custom-mismatch", "schedules", "`custom_schedule` with `schedule='1f1b'`",
      lambda env: mm.microbatch(lambda x: x, 0, 2, schedule="1f1b",
                                custom_schedule=[["F0.0", "B0.0"]]),
      E.MicrobatchArgumentError, ("`schedule`='1f1b'", "custom_schedule` goes with"),
      "use `schedule='custom'` (or drop `custom_schedule`)"),
    M("schedule-num-stages", "schedules", "`num_stages=3` for a 2-task pipeline",
      lambda env: mm.jit(jax.grad(_chain(schedule="1f1b", num_stages=3)))(env.ws, env.x),
      E.InvalidScheduleError, ("`num_stages`=3", "2 task(s)", "Pass `num_stages`=2"),
      "pass the number of tasks per microbatch"),
    M("schedule-interleave", "schedules", "`interleave=2` with one stage per submesh",
      lambda env: mm.jit(jax.grad(_chain(schedule="interleaved-1f1b", interleave=2)))(
          env.ws, env.x),
      E.InvalidScheduleError, ("`interleave`=2", "Pass `interleave`=1"),
      "pass the stages per submesh"),
    M("schedule-custom-task-name", "schedules", "a custom schedule naming an unknown task",
      lambda env: mm.jit(jax.grad(_chain(custom_schedule=[
          [("first", 0, "F"), ("first", 1, "F"), ("first", 0, "B"), ("first", 1, "B")],
          [("third", 0, "F"), ("third", 1, "F"), ("third", 0, "B"), ("third", 1, "B")]])))(
          env.ws, env.x),
      E.InvalidScheduleError, ("'third'", "['first', 'second']"),
      "use the task names listed, or stage indices"),
    M("schedule-name", "schedules", "`make_schedule('zigzag', ...)`",
      lambda env: mm.make_schedule("zigzag", 2, 2),
      E.InvalidScheduleError, ("'zigzag'", "Use one of"), "use one of the names"),
    M("schedule-stages-per-row", "schedules", "1F1B with 2 stages per submesh",
      lambda env: mm.make_schedule("1f1b", 4, 4, num_submeshes=2),
      E.InvalidScheduleError, ("2 stages per submesh", "'interleaved-1f1b'"),
      "use 'interleaved-1f1b' or 'gpipe', or one submesh per stage"),
    M("schedule-missing-op", "schedules", "a custom order without `B1.0`",
      lambda env: _custom(["F0.0", "B0.0"], ["F1.0"]),
      E.InvalidScheduleError, ("B1.0",), "add the missing op"),
    M("schedule-bad-op", "schedules", "a custom op written `X0.1`",
      lambda env: _custom(["X0.1"], ["F1.0"]),
      E.InvalidScheduleError, ("'X0.1'", "'F0.3'"), "write ops as `<phase><stage>.<mb>`"),
    M("schedule-deadlock", "schedules", "a custom order that deadlocks",
      lambda env: _custom(["F0.0", "B0.0"], ["B1.0", "F1.0"]),
      E.InvalidScheduleError, ("deadlocks", "B1.0"), "reorder the row"),
    M("schedule-not-a-schedule", "schedules", "`validate_schedule` of a list",
      lambda env: mm.validate_schedule([["F0.0"]]),
      E.InvalidScheduleError, ("list: [['F0.0']]", "make_schedule"),
      "build a `Schedule` with `make_schedule`"),
    M("schedule-max-in-flight", "schedules", "`max_in_flight` for a fixed schedule (1F1B)",
      lambda env: mm.make_schedule("1f1b", 4, 8, max_in_flight=4),
      E.InvalidScheduleError, ("`max_in_flight`", "'zero-bubble-auto'", "'1f1b'"),
      "use 'zero-bubble-auto' or 'zero-bubble-v', or drop it"),
    M("schedule-v-layout", "schedules", "`zero-bubble-v` with 3 stages per submesh",
      lambda env: mm.make_schedule("zero-bubble-v", 6, 4, num_submeshes=2),
      E.InvalidScheduleError, ("two stages per submesh", "`num_stages` = 4"),
      "give it 2R stages on R submeshes"),
    M("simulate-negative-cost", "schedules", "a negative cost in `simulate`",
      lambda env: mm.simulate(mm.make_schedule("1f1b", 2, 2), costs={"F": -1.0}),
      E.InvalidScheduleError, ("-1.0",), "pass non-negative costs"),
    # --- Flax wrappers ---
    M("flax-instance", "Flax wrappers", "`layers.task(nn.Dense(4))` (an instance)",
      lambda env: mm.layers.task(nn.Dense(4), mesh=TM(devices=[0])),
      E.TaskTypeError, ("instance of Dense", "Pass the class, not an instance"),
      "pass the class"),
    M("flax-function", "Flax wrappers", "`layers.task(fn)` with a plain function",
      lambda env: mm.layers.task(_double, mesh=TM(devices=[0])),
      E.TaskTypeError, ("function: <function _double", "multimesh_flax.core.task"),
      "use `multimesh_flax.task` for functions"),
    M("flax-rules-without-mesh", "Flax wrappers", "`logical_axes` without a mesh",
      lambda env: mm.layers.task(nn.Dense, logical_axes=[("embed", "x")]),
      E.InvalidTaskError, ("[('embed', 'x')]", "Give `mesh`"),
      "give `mesh`, `mesh_slice` or `devices` with `device_axes`"),
    M("flax-rules-unknown-axis", "Flax wrappers", "a `Task[Dense]` rule naming a missing axis",
      lambda env: mm.jit(lambda x: _BadRules().init(_key(), x))(env.x),
      E.LogicalRulesError, ("('embed', 'y')", "axes ('x',)"),
      "map logical names onto the task mesh's axes"),
    M("flax-slice-without-multimesh", "Flax wrappers", "a `mesh_slice` module, no MultiMesh",
      lambda env: mm.parallelize_step(_SliceNet(), optax.sgd(0.1), global_batch=env.x),
      E.NoMultiMeshError, ("{'stage': 0}", "`with multi_mesh:`"),
      "pass a `MultiMesh` as `mesh` (or open one)"),
    M("shard-axes-type", "Flax wrappers", "`shard_axes(3)`",
      lambda env: mm.shard_axes(3),
      E.LogicalRulesError, ("got 3", "shard_axes('embed', 'mlp')"), "pass names or `None`"),
    M("tabulate-class", "Flax wrappers", "`tabulate(Model, ...)` (the class)",
      lambda env: mm.tabulate(_Net, _key(), env.x),
      E.TaskTypeError, ("the class _Net", "Instantiate the class first"), "pass an instance"),
    # --- parallelize_step ---
    M("step-model-class", "parallelize_step", "the model class instead of an instance",
      lambda env: mm.parallelize_step(_Net, optax.sgd(0.1), global_batch=env.x),
      E.ParallelizeArgumentError, ("_Net", "Instantiate the class first"),
      "instantiate the model"),
    M("step-optimizer", "parallelize_step", "`optax.adam` (not called)",
      lambda env: mm.parallelize_step(_Net(), optax.adam, global_batch=env.x),
      E.ParallelizeArgumentError, ("function", "optax.adamw(1e-3)"),
      "pass an optax `GradientTransformation`"),
    M("step-both-batches", "parallelize_step", "both `global_batch` and `local_batch`",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                      local_batch=env.x),
      E.ParallelizeArgumentError, ("got both", "Pass `global_batch`"),
      "pass exactly one example batch"),
    M("step-no-batch", "parallelize_step", "no example batch",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1)),
      E.ParallelizeArgumentError, ("got neither", "Pass `global_batch`"),
      "pass `global_batch`"),
    M("step-batch-leaf", "parallelize_step", "a batch of Python ints",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=[1, 2]),
      E.ParallelizeArgumentError, ("int: 1", "[0]", "jnp.asarray"),
      "convert the batch with `jnp.asarray`"),
    M("step-loss-shape", "parallelize_step", "a model whose output (the loss) is a vector",
      lambda env: mm.parallelize_step(_Vector(), optax.sgd(0.1), global_batch=env.x),
      E.ParallelizeArgumentError, ("float32[8, 2]", "`.mean()`"), "reduce the loss"),
    M("step-loss-fn-type", "parallelize_step", "`loss_fn='mse'` (not a function)",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                      loss_fn="mse"),
      E.ParallelizeArgumentError, ("str: 'mse'", "loss_fn(model_fn, batch)"),
      "pass a function `loss_fn(model_fn, batch)`"),
    M("step-loss-fn-no-model", "parallelize_step", "a `loss_fn` that never calls the model",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                      loss_fn=lambda model_fn, batch: batch.sum()),
      E.ParallelizeArgumentError, ("never did", "Call `model_fn(inputs)`"),
      "call `model_fn` inside `loss_fn`"),
    M("step-microbatches-uneven", "parallelize_step", "`microbatches=3` for a batch of 8",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                      microbatches=3),
      E.ParallelizeArgumentError, ("`microbatches`=3", "['8']", "divides the batch"),
      "choose a count that divides the batch"),
    M("step-microbatches-type", "parallelize_step", "`microbatches=True`",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                      microbatches=True),
      E.ParallelizeArgumentError, ("got True", "`microbatches=4`"), "pass a positive int"),
    M("step-schedule-alone", "parallelize_step", "`schedule='1f1b'` without `microbatches`",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                      schedule="1f1b"),
      E.ParallelizeArgumentError, ("'1f1b'", "pass `microbatches=m`"),
      "pass `microbatches`"),
    M("step-schedule-unknown", "parallelize_step", "`schedule='zb'`",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                      microbatches=2, schedule="zb"),
      E.InvalidScheduleError, ("'zb'", "'zero-bubble-h2'"), "use one of the names"),
    M("step-recompute", "parallelize_step", "`recompute='selective'` (not a policy)",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                      recompute="selective"),
      E.RecomputePolicyError, ("'selective'", "'dots'", "`recompute='full'`"),
      "pass `None`, `False`, `True`/`'full'`, `'dots'` or a checkpoint policy"),
    M("step-precision", "parallelize_step", "`precision='fp16'`",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                      precision="fp16"),
      E.ParallelizeArgumentError, ("str: 'fp16'", "'pure-bf16'", "precision='bf16'"),
      "pass `'fp32'`, `'bf16'` or `'pure-bf16'`"),
    M("step-mesh-type", "parallelize_step", "`mesh=[0, 1]`",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), [0, 1], env.x),
      E.ParallelizeArgumentError, ("list: [0, 1]", "`MultiMesh(axis_sizes="),
      "pass a `jax.sharding.Mesh`, a `MultiMesh` or `None`"),
    M("step-rng", "parallelize_step", "`rng=3` (an int seed)",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x, rng=3),
      E.ParallelizeArgumentError, ("int: 3", "rng=jax.random.key(3)"),
      "pass `jax.random.key(seed)`"),
    M("step-split-inputs", "parallelize_step", "`replicate_inputs=False` with a batch of 5 "
      "for a 2-device submesh", lambda env: mm.parallelize_step(
          _Net(), optax.sgd(0.1), global_batch=jnp.ones((5, 4)), replicate_inputs=False),
      E.ParallelizeArgumentError, ("(5, 4)", "multiple of 2", "`replicate_inputs=True`"),
      "use a batch size that the submesh divides, or replicate inputs"),
    M("step-wrong-state", "parallelize_step", "`step_fn(state.params, batch)`",
      lambda env: env.step(env.state.params, env.x),
      E.ParallelizeArgumentError, ("got a dict", "state.replace(params=...)"),
      "pass the state the step returned", after=lambda env: env.check_step()),
    M("step-other-state", "parallelize_step", "`step_fn(state, batch)` with the state of "
      "another model (the same tree, wider kernels)",
      lambda env: env.step(_widened(env.state), env.x),
      E.ParallelizeArgumentError, ("differs in 4 leaves", "float32[4, 5] where the step "
                                   "expects float32[4, 4]", "another model"),
      "pass the state the step returned", after=lambda env: env.check_step()),
    M("step-batch-empty", "parallelize_step", "a batch of 0 examples (a data loader that ran "
      "dry) for a step with `microbatches=2`", lambda env: env.step(env.state, env.x[:0]),
      E.ParallelizeArgumentError, ("shape (0, 4)", "at least one example", "skip empty"),
      "skip empty batches", after=lambda env: env.check_step()),
    M("step-batch-uneven", "parallelize_step", "a batch of 5 for `microbatches=2`",
      lambda env: env.step(env.state, env.x[:5]),
      E.UnevenMicrobatchError, ("`microbatches`=2", "batch of 5", "multiple of 2"),
      "pass batches the microbatch count divides", after=lambda env: env.check_step()),
    M("step-nonfinite-value", "parallelize_step", "`nonfinite='warn'` (not an option)",
      lambda env: mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                      nonfinite="warn"),
      E.ParallelizeArgumentError, ("got str: 'warn'", "`nonfinite='skip'`"),
      "pass `None`, `'raise'` or `'skip'`"),
    M("step-nonfinite", "parallelize_step", "a step built with `nonfinite='raise'` meets a "
      "NaN loss (a NaN in the batch; likewise a learning rate that diverges)",
      lambda env: _nonfinite_step(env),
      E.NonFiniteError, ("`state.step`=0", "loss nan and gradient norm nan", "`error.state`",
                         "Lower the learning rate", "`nonfinite='skip'`"),
      "continue from `error.state`; lower the learning rate, check the data, or use `'skip'`",
      after=lambda env: _nonfinite_step(env, env.x)),
    # --- jit and parallelize ---
    M("jit-static-negative", "jit/parallelize", "`static_argnums=-1`",
      lambda env: mm.jit(lambda x: x, static_argnums=-1),
      E.StaticArgumentError, ("-1", "`static_argnums=(1,)`"), "pass non-negative indices"),
    M("jit-donate-type", "jit/parallelize", "`donate_argnums='0'`",
      lambda env: mm.jit(lambda x: x, donate_argnums="0"),
      E.StaticArgumentError, ("'0'", "`donate_argnums=(1,)`"), "pass ints"),
    M("jit-static-beyond", "jit/parallelize", "a static argnum beyond the call's arguments",
      lambda env: env.static(env.x),
      E.StaticArgumentError, ("argument 1", "1 positional", "Pass it"),
      "pass the static argument, or fix `static_argnums`",
      after=lambda env: env.check_static()),
    M("jit-static-unhashable", "jit/parallelize", "a list as a static argument",
      lambda env: env.static(env.x, ["a", "b"]),
      E.StaticArgumentError, ("['a', 'b']", "convert lists to tuples"),
      "pass hashable statics (tuples)", after=lambda env: env.check_static()),
    M("jit-not-callable", "jit/parallelize", "`jit(f(x))` (a result, not a function)",
      lambda env: mm.jit(3),
      E.ParallelizeArgumentError, ("int: 3", "not its result"), "pass the function"),
    M("jit-no-devices", "jit/parallelize", "`jit(f, devices=[])`",
      lambda env: mm.jit(lambda x: x, devices=[]),
      E.ParallelizeArgumentError, ("at least one device", "got none"), "pass devices"),
    M("jit-duplicate-devices", "jit/parallelize", "one device twice in `devices`",
      lambda env: mm.jit(lambda x: x * 2, devices=[jax.devices()[0]] * 2)(env.x),
      E.DuplicateDeviceError, ("CpuDevice(id=0) more than once", "List each one once"),
      "list each device once"),
    M("parallelize-both-batches", "jit/parallelize", "both `get_input_batch` and "
      "`initial_batch`", lambda env: mm.parallelize(
          lambda p, b: b, init_params=lambda: 1.0, get_input_batch=lambda: env.x,
          initial_batch=env.x),
      E.ParallelizeArgumentError, ("got both", "Pass one"), "pass one of them"),
    M("parallelize-params-value", "jit/parallelize", "`init_params=params` (not a function)",
      lambda env: mm.parallelize(lambda p, b: b, init_params={"w": 1.0}, initial_batch=env.x),
      E.ParallelizeArgumentError, ("dict: {'w': 1.0}", "`init_params=lambda: value`"),
      "pass a function of no arguments"),
    M("parallelize-not-callable", "jit/parallelize", "`parallelize(3, ...)`",
      lambda env: mm.parallelize(3, initial_batch=env.x),
      E.ParallelizeArgumentError, ("int: 3", "fun(params, batch)", "Pass the function itself"),
      "pass the function"),
    # --- contexts ---
    M("context-string-switch", "contexts", "`autoshard('false')` (a string turns it on)",
      lambda env: _in(mm.autoshard("false"), lambda: None),
      E.ContextFlagError, ("`autoshard`", "str: 'false'", "Pass a bool"), "pass a bool"),
    M("context-several", "contexts", "`context(ignore_transforms='yes')`",
      lambda env: _in(mm.context(autoshard=True, ignore_transforms="yes"), lambda: None),
      E.ContextFlagError, ("`ignore_transforms`", "'yes'"), "pass a bool (or None)"),
    M("context-unknown-switch", "contexts", "`get_flag('autoshards')`",
      lambda env: mm.core.get_flag("autoshards"),
      E.ContextFlagError, ("'autoshards'", "'autoshard'"), "use one of the five switches"),
    M("timeline-empty", "contexts", "`recorded_bubble` of an empty timeline",
      lambda env: mm.recorded_bubble(mm.Timeline()),
      E.TimelineDataError, ("no events", "inside `record_timeline`"),
      "record a `jit` call inside `record_timeline`"),
    # --- checkpoints ---
    M("ckpt-missing-dir", "checkpoints", "restore from a directory that does not exist",
      lambda env: checkpoint.restore_checkpoint(env.root / "missing"),
      E.CheckpointNotFoundError, ("missing'", "does not exist", "directory given to `save`"),
      "pass the directory given to `save`"),
    M("ckpt-unknown-step", "checkpoints", "restore a step that was never saved",
      lambda env: checkpoint.restore_checkpoint(env.ckpt, step=7),
      E.CheckpointNotFoundError, ("[1]", "got 7", "None for the latest"),
      "pass a saved step, or `None`"),
    M("ckpt-target-shape", "checkpoints", "a restore target of another shape",
      lambda env: checkpoint.restore_checkpoint(env.ckpt, {"step": 0, "w": jnp.zeros(5)}),
      E.CheckpointMismatchError, ("`w`", "shape (4,) float32", "shape (5,) float32",
                                  "same model and optimizer"),
      "build the target from the saved configuration"),
    M("ckpt-target-tree", "checkpoints", "a restore target with other keys",
      lambda env: checkpoint.restore_checkpoint(env.ckpt, {"step": 0, "v": jnp.zeros(4)}),
      E.CheckpointMismatchError, ("`w`", "received missing"),
      "build the target from the saved configuration"),
    M("ckpt-old-step", "checkpoints", "save under a step not above the latest",
      lambda env: _save(env, 1),
      E.CheckpointStepError, ("latest saved step 1", "got 1", "larger step"),
      "save under a larger step, or into a fresh directory"),
    M("ckpt-negative-step", "checkpoints", "save under step -3",
      lambda env: _save(env, -3),
      E.CheckpointStepError, ("got -3", "training step (0, 1, ...)"), "pass a step >= 0"),
    M("ckpt-metadata", "checkpoints", "metadata holding a numpy array",
      lambda env: _save(env, 2, metadata={"mask": np.ones(2)}),
      E.CheckpointMetadataError, ("ndarray", "`.tolist()`"), "convert arrays with `.tolist()`"),
    M("ckpt-string-leaf", "checkpoints", "a state with a string leaf",
      lambda env: _save(env, 2, {"w": jnp.ones(4), "name": "run1"}),
      E.CheckpointArgumentError, ("['name']", "'run1'", "into `metadata`"),
      "keep strings in `metadata`"),
    M("ckpt-none-state", "checkpoints", "saving `None` as the state",
      lambda env: checkpoint.save_checkpoint(env.ckpt, 2, None),
      E.CheckpointArgumentError, ("got None", "at least one array"), "pass the training state"),
    M("ckpt-read-only", "checkpoints", "`save` on a read-only checkpointer",
      lambda env: _save_into(env),
      E.CheckpointReadOnlyError, ("step 2", "`read_only=True`", "Checkpointer(directory)"),
      "open it without `read_only`"),
    M("ckpt-file-directory", "checkpoints", "a file path as checkpoint directory",
      lambda env: checkpoint.save_checkpoint(env.file, 1, env.saved),
      E.CheckpointArgumentError, ("notes.txt' is a file", "directory path"),
      "pass a directory path"),
    M("ckpt-changed-bytes", "checkpoints", "restore a checkpoint whose data bytes changed",
      lambda env: checkpoint.restore_checkpoint(_damaged_ckpt(env, "bytes")),
      E.CheckpointCorruptError, ("step 1", "`w`", "checksum", "from a good source"),
      "restore an earlier step, or copy the checkpoint again"),
    M("ckpt-garbage-metadata", "checkpoints", "read metadata that is not JSON",
      lambda env: checkpoint.restore_metadata(_damaged_ckpt(env, "json")),
      E.CheckpointCorruptError, ("metadata file", "not valid JSON", "from a good source"),
      "restore an earlier step, or copy the checkpoint again"),
    M("ckpt-dir-under-file", "checkpoints", "save into a folder whose parent is a file",
      lambda env: checkpoint.save_checkpoint(env.file / "ckpt", 1, env.saved),
      E.CheckpointSaveError, ("notes.txt/ckpt'", "Not a directory", "save elsewhere"),
      "save into a writable folder"),
    M("ckpt-max-to-keep", "checkpoints", "`max_to_keep=0`",
      lambda env: checkpoint.Checkpointer(env.ckpt, max_to_keep=0),
      E.CheckpointArgumentError, ("got 0", "`max_to_keep=3`"),
      "pass a positive count or `None`"),
    # --- reference models ---
    M("model-preset", "models", "`get_config('gpt-huge')`",
      lambda env: _models().get_config("gpt-huge"),
      E.ModelConfigError, ("'gpt-huge'", "gpt-tiny, gpt-small"), "use a listed preset"),
    M("model-override", "models", "`get_config('gpt-tiny', num_layer=4)` (misspelt field)",
      lambda env: _models().get_config("gpt-tiny", num_layer=4),
      E.ModelConfigError, ("'num_layer'", "num_layers"), "use a `ModelConfig` field"),
    M("model-heads", "models", "`num_kv_heads` that does not divide `num_heads`",
      lambda env: _models().get_config("llama-tiny", num_kv_heads=3),
      E.ModelConfigError, ("(3)", "divide `num_heads` (4)"), "pick a divisor"),
    M("model-stages", "models", "`GPT(config, stages=3)` for 2 blocks",
      lambda env: jax.eval_shape(_models().GPT(_models().get_config("gpt-tiny"), stages=3).init,
                                 _key(), jnp.zeros((2, 8), jnp.int32)),
      E.InvalidTaskError, ("got 3", "one of [1, 2]"), "pick a stage count that divides"),
    M("model-multimesh", "models", "`make_multimesh(2, 2, 1)` on 8 devices",
      lambda env: _models().pipeline.make_multimesh(2, 2, 1),
      E.MeshShapeError, ("= 8", "2 x 2 x 1 = 4"), "make the product the device count"),
    M("model-seq-len", "models", "`GPT` (`max_len` 128) applied to 129 tokens",
      lambda env: jax.eval_shape(_models().GPT(_models().get_config("gpt-tiny")).init, _key(),
                                 jax.ShapeDtypeStruct((2, 129), jnp.int32)),
      E.SequenceLengthError, ("129 tokens", "`max_len` is 128", "shorter `seq_len`",
                              "max_len=256"),
      "use shorter sequences or a config with a larger `max_len`"),
    M("model-sliding-window", "models", "a Llama with `sliding_window` 16 applied to 17 tokens",
      lambda env: jax.eval_shape(
          _models().Llama(_models().get_config("llama-tiny", sliding_window=16)).init, _key(),
          jax.ShapeDtypeStruct((2, 17), jnp.int32)),
      E.SequenceLengthError, ("17 tokens", "`sliding_window` is 16", "at most 16 tokens"),
      "use sequences no longer than the window"),
    # --- pretrained checkpoints (models.hf) ---
    M("hf-no-config", "pretrained checkpoints", "`hf.load` of a folder without config.json",
      lambda env: _hf().load(_hf_folder(env, "no-config")),
      E.PretrainedConfigError, ("config.json", "save_pretrained"),
      "point at the folder `save_pretrained` wrote"),
    M("hf-architecture", "pretrained checkpoints", "`hf.load` of a Gemma checkpoint",
      lambda env: _hf().load(_hf_folder(env, "architecture")),
      E.UnsupportedArchitectureError, ("GemmaForCausalLM", "Qwen3ForCausalLM",
                                       "`hidden_activation`='gelu_pytorch_tanh'",
                                       "sqrt(`hidden_size`)"),
      "convert the model to a supported architecture; the message lists what Gemma needs"),
    M("hf-missing-tensor", "pretrained checkpoints", "config.json says 5 layers, weights hold 4",
      lambda env: _hf().load(_hf_folder(env, "missing-tensor")),
      E.PretrainedTensorError, ("'transformer.h.4.ln_1.weight'", "missing", "Fix config.json"),
      "fix config.json or copy the complete checkpoint"),
    M("hf-extra-tensor", "pretrained checkpoints", "config.json says 2 layers, weights hold 4",
      lambda env: _hf().load(_hf_folder(env, "extra-tensor")),
      E.PretrainedTensorError, ("'transformer.h.2.", "model.safetensors", "not part of"),
      "fix config.json or remove the tensors"),
    M("hf-shape", "pretrained checkpoints", "a tensor whose shape config.json contradicts",
      lambda env: _hf().load(_hf_folder(env, "shape")),
      E.PretrainedTensorError, ("'transformer.wpe.weight'", "(64, 32)", "implies (32, 32)"),
      "fix config.json or the checkpoint"),
    M("hf-truncated", "pretrained checkpoints", "a truncated safetensors shard",
      lambda env: _hf().load(_hf_folder(env, "truncated")),
      E.PretrainedTensorError, ("model-00003-of-00006.safetensors", "truncated", "Re-download"),
      "re-download or re-save the checkpoint"),
    M("hf-non-finite", "pretrained checkpoints", "a tensor holding NaN/inf values",
      lambda env: _hf().load(_hf_folder(env, "non-finite")),
      E.PretrainedTensorError, ("'transformer.h.1.mlp.c_fc.weight'", "model.safetensors",
                                "3 non-finite", "Re-download or re-save"),
      "re-download or re-save the checkpoint from finite weights"),
    M("hf-int-tensor", "pretrained checkpoints", "an int32 tensor where weights are floats",
      lambda env: _hf().load(_hf_folder(env, "int-tensor")),
      E.PretrainedTensorError, ("'transformer.h.1.mlp.c_fc.weight'", "dtype I32",
                                "floating-point weights"),
      "re-save the checkpoint with floating-point weights"),
    M("hf-vocab-split", "pretrained checkpoints", "a 319-id vocabulary on a `model` axis of 2",
      lambda env: _hf().load_placed(_hf_folder(env, "odd-vocab"),
                                    _models().pipeline.make_multimesh(2, 2, 2), stages=2),
      E.VocabularySplitError, ("(319 ids)", "`vocab_multiple=2`", "320 ids"),
      "pad with `vocab_multiple`, or use a `model` axis that divides it"),
    M("hf-stages", "pretrained checkpoints", "`hf.load(..., stages=3)` for 4 layers",
      lambda env: _hf().load(_HF / "gpt2", stages=3),
      E.InvalidTaskError, ("got 3", "one of [1, 2, 4]"), "pick a stage count that divides"),
    M("hf-save-exists", "pretrained checkpoints", "`hf.save` into an existing model folder",
      lambda env: _hf().save(_HF / "gpt2", *_hf().load(_HF / "gpt2")),
      E.PretrainedConfigError, ("already exists", "`overwrite=True`"),
      "save into a new folder or pass `overwrite=True`"),
    M("hf-save-params", "pretrained checkpoints", "`hf.save` of parameters of another model",
      lambda env: _hf().save(env.root.parent / "hf-never-written", _hf().load(_HF / "gpt2")[0],
                             _hf().load(_HF / "llama")[1]),
      E.PretrainedTensorError, ("parameters of GPT", "make_model(config)"),
      "pass the `params` of `make_model(config)`"),
    # --- command line ---
    M("cli-demo-devices", "CLI", "`mmflax demo --devices 3`",
      lambda env: _cli(env, "demo", "--devices", "3"),
      CommandLineExit, ("got 3", "even number >= 2"), "pass an even count"),
    M("cli-int", "CLI", "`mmflax demo --devices abc`",
      lambda env: _cli(env, "demo", "--devices", "abc"),
      CommandLineExit, ("'abc'", "mmflax demo --help"), "pass an integer"),
    M("cli-command", "CLI", "`mmflax fly`",
      lambda env: _cli(env, "fly"),
      CommandLineExit, ("'fly'", "'demo', 'train', 'plan', 'sample'"), "use a listed command"),
    M("cli-stages", "CLI", "`mmflax train --stages 3` (2 layers)",
      lambda env: _cli(env, "train", "--stages", "3"),
      CommandLineExit, ("`--stages` 3", "[1, 2]", "--layers"), "pick a divisor of the layers"),
    M("cli-model", "CLI", "`mmflax train --model gpt-huge`",
      lambda env: _cli(env, "train", "--model", "gpt-huge"),
      CommandLineExit, ("'gpt-huge'", "gpt-tiny"), "use a listed preset"),
    M("cli-schedule", "CLI", "`mmflax train --schedule zigzag`",
      lambda env: _cli(env, "train", "--schedule", "zigzag"),
      CommandLineExit, ("'zigzag'", "'1f1b'"), "use a listed schedule"),
    M("cli-layout", "CLI", "`mmflax train --data 3` (2 x 3 x 2 != 8 devices)",
      lambda env: _cli(env, "train", "--data", "3"),
      CommandLineExit, ("2 x 3 x 2 = 12", "= 8"), "make the product the device count"),
    M("cli-microbatches", "CLI", "`mmflax train --batch-size 16 --microbatches 3`",
      lambda env: _cli(env, "train", "--batch-size", "16", "--microbatches", "3"),
      CommandLineExit, ("got 16", "--batch-size 18"), "use a batch the microbatches divide"),
    M("cli-devices-late", "CLI", "`mmflax train --devices 4` after JAX started with 8",
      lambda env: _cli(env, "train", "--devices", "4"),
      CommandLineExit, ("8 CPU devices", "`--devices 8`"),
      "pass the running count, or use a fresh process"),
    M("cli-sample-missing", "CLI", "`mmflax sample --checkpoint` of a missing run",
      lambda env: _cli(env, "sample", "--checkpoint", str(env.root / "no-run")),
      CommandLineExit, ("no-run'", "--out` folder"), "pass the `--out` folder of a run"),
    M("cli-sample-required", "CLI", "`mmflax sample` without `--checkpoint`",
      lambda env: _cli(env, "sample"),
      CommandLineExit, ("--checkpoint", "mmflax sample --help"), "pass `--checkpoint`"),
    M("cli-init-from-model", "CLI", "`mmflax train --init-from DIR --model gpt-tiny`",
      lambda env: _cli(env, "train", "--init-from", str(_HF / "gpt2"), "--model", "gpt-tiny"),
      CommandLineExit, ("both choose the model", "Drop `--model`"), "drop one of the two"),
    M("cli-init-from-missing", "CLI", "`mmflax train --init-from` a folder without config.json",
      lambda env: _cli(env, "train", "--init-from", str(env.root / "no-model")),
      CommandLineExit, ("no-model/config.json", "save_pretrained"),
      "point at the folder `save_pretrained` wrote"),
    M("cli-export-exists", "CLI", "`mmflax export --to` an existing folder",
      lambda env: _cli(env, "export", "--checkpoint", str(env.root / "no-run"),
                       "--to", str(_HF / "gpt2")),
      CommandLineExit, ("gpt2' already exists", "another `--to`"), "choose a new `--to` folder"),
    # --- issue 17: mistakes that used to crash, misplace or mislead ---
    M("step-consumed-state", "parallelize_step", "`step(state, x)` twice (`state` not rebound: "
      "the first step consumed it)", lambda env: _step_twice(env),
      E.ConsumedArrayError, ("args[0].", "consumed by an earlier call", "donate_argnums",
                             "loss, state = step_fn(state, batch)"),
      "use the state the earlier step returned", after=lambda env: env.check_step()),
    M("jit-consumed-input", "jit/parallelize", "an `mm.jit(..., donate_argnums=0)` input reused",
      lambda env: _donate_twice(env),
      E.ConsumedArrayError, ("`args[0]`", "float32[8, 4]", "`donate_argnums`=(0,)",
                             "Pass what that call returned"),
      "pass what the earlier call returned"),
    M("cli-out-file", "CLI", "`mmflax train --out notes.txt` (an existing file)",
      lambda env: _cli(env, "train", "--out", str(env.file)),
      CommandLineExit, ("notes.txt'", "existing file", "another `--out`"),
      "choose another `--out` path"),
    M("cli-resume-foreign", "CLI", "`mmflax train --resume --out DIR` of a checkpoint that "
      "`mmflax train` did not write (no run settings in its metadata)",
      lambda env: _cli(env, "train", "--resume", "--out", str(_foreign_run(env))),
      CommandLineExit, ("no `mmflax train` settings", "found keys ['lr']", "another `--out`"),
      "start a new run in another `--out`"),
    # --- issue 35: users' own data in `mmflax train --dataset` ---
    M("cli-dataset-missing", "CLI", "`mmflax train --dataset missing.jsonl`",
      lambda env: _cli(env, "train", "--dataset", str(env.root / "missing.jsonl")),
      CommandLineExit, ("missing.jsonl' does not exist", ".txt, .jsonl or .parquet"),
      "pass an existing file or folder"),
    M("cli-dataset-folder", "CLI", "`mmflax train --dataset DIR` (a folder without text files)",
      lambda env: _cli(env, "train", "--dataset",
                       str(_data_file(env, "csv/notes.csv", b"a,b").parent)),
      CommandLineExit, ("to hold .txt, .jsonl or .parquet files, found none",),
      "point `--dataset` at such files"),
    M("cli-dataset-empty", "CLI", "`mmflax train --dataset empty.txt` (an empty file)",
      lambda env: _cli(env, "train", "--dataset", str(_data_file(env, "empty.txt", b""))),
      CommandLineExit, ("empty.txt', found an empty file", "fill it"),
      "remove or fill the file"),
    M("cli-dataset-binary", "CLI", "`mmflax train --dataset image.txt` (bytes, not UTF-8 text)",
      lambda env: _cli(env, "train", "--dataset",
                       str(_data_file(env, "image.txt", b"\x89PNG\r\n\x1a\n\x00"))),
      CommandLineExit, ("Expected UTF-8 text", "byte 0x89 at offset 0", "Convert it to UTF-8"),
      "convert the file to UTF-8 text or remove it"),
    M("cli-dataset-field", "CLI", "`mmflax train --dataset a.jsonl` whose line lacks `text`",
      lambda env: _cli(env, "train", "--dataset", str(_data_file(
          env, "field.jsonl", b'{"text": "a"}\n{"body": "b"}\n'))),
      CommandLineExit, ("line 2 of", "string field 'text', got ['body']", "`--text-field`"),
      "pass `--text-field` or fix the line"),
    M("cli-dataset-small", "CLI", "`mmflax train --dataset` of 100 bytes (under one batch)",
      lambda env: _cli(env, "train", "--dataset", str(_data_file(env, "small.txt", b"x" * 99))),
      CommandLineExit, ("`--batch-size` 32", "got 100 tokens: 1 training windows",
                        "lower `--batch-size` or `--seq-len`"),
      "add text, or lower `--batch-size` or `--seq-len`"),
    M("cli-eval-fraction-range", "CLI", "`mmflax train --dataset F --eval-fraction 1.5`",
      lambda env: _cli(env, "train", "--dataset", str(_data_file(env, "small.txt", b"x" * 99)),
                       "--eval-fraction", "1.5"),
      CommandLineExit, ("strictly between 0 and 1", "got 1.5", "--eval-fraction 0.05"),
      "pass a fraction inside (0, 1)"),
    M("cli-eval-fraction-empty", "CLI", "`--eval-fraction 0.001` of a 3-window `--dataset` "
      "(no window held out)",
      lambda env: _cli(env, "train", "--dataset", str(_data_file(env, "small.txt", b"x" * 99)),
                       "--batch-size", "2", "--microbatches", "1", "--data", "2",
                       "--seq-len", "32", "--eval-fraction", "0.001"),
      CommandLineExit, ("`--eval-fraction` 0.001", "holds out no window",
                        "Raise `--eval-fraction`"),
      "raise `--eval-fraction`, or add text"),
    M("cli-eval-without-dataset", "CLI", "`mmflax train --eval-fraction 0.1` (no `--dataset`)",
      lambda env: _cli(env, "train", "--eval-fraction", "0.1"),
      CommandLineExit, ("no held-out split", "Pass `--dataset PATH`"),
      "pass `--dataset`, or drop `--eval-fraction`"),
    # --- issue 35: the fine-tuning recipe of `mmflax train` ---
    M("cli-grad-accum", "CLI", "`mmflax train --grad-accum 0`",
      lambda env: _cli(env, "train", "--grad-accum", "0"),
      CommandLineExit, ("`--grad-accum` to be a positive integer, got 0",),
      "pass a positive count of batches"),
    M("cli-clip-norm", "CLI", "`mmflax train --clip-norm -1`",
      lambda env: _cli(env, "train", "--clip-norm", "-1"),
      CommandLineExit, ("`--clip-norm` to be a positive number", "or 0 or 'none'", "got -1.0"),
      "pass a positive norm, or 0/`none` for no clipping"),
    M("cli-clip-norm-word", "CLI", "`mmflax train --clip-norm off`",
      lambda env: _cli(env, "train", "--clip-norm", "off"),
      CommandLineExit, ("a number >= 0 or 'none'", "got 'off'", "mmflax train --help"),
      "pass a number or `none`"),
    M("cli-min-lr-ratio", "CLI", "`mmflax train --lr-schedule cosine --min-lr-ratio 2`",
      lambda env: _cli(env, "train", "--lr-schedule", "cosine", "--min-lr-ratio", "2"),
      CommandLineExit, ("`--min-lr-ratio` between 0 and 1", "got 2.0", "--min-lr-ratio 0.1"),
      "pass a share of `--lr` between 0 and 1"),
    M("cli-cosine-short", "CLI", "`mmflax train --lr-schedule cosine --steps 20` (30 warm-up "
      "steps)", lambda env: _cli(env, "train", "--lr-schedule", "cosine", "--steps", "20"),
      CommandLineExit, ("`--warmup` of 30 steps", "last step, 20", "`--warmup` <= 18"),
      "shorten `--warmup`, add `--steps`, or use the constant schedule"),
    M("cli-precision", "CLI", "`mmflax train --precision fp16`",
      lambda env: _cli(env, "train", "--precision", "fp16"),
      CommandLineExit, ("'fp16'", "'bf16', 'pure-bf16'"), "use a listed precision"),
    M("cli-recompute", "CLI", "`mmflax train --recompute all`",
      lambda env: _cli(env, "train", "--recompute", "all"),
      CommandLineExit, ("'all'", "'none', 'full', 'dots'"), "use a listed policy"),
    M("cli-reference-bf16", "CLI", "`mmflax train --precision bf16 --check-reference`",
      lambda env: _cli(env, "train", "--precision", "bf16", "--check-reference"),
      CommandLineExit, ("`--precision` 'bf16' rounds to bfloat16", "`--precision fp32`"),
      "check the layout in fp32, or drop `--check-reference`"),
    M("slice-index-type", "meshes", "`MultiMesh.slice(stage=1.0)` (a float index)",
      lambda env: env.multi.slice(stage=1.0),
      E.MeshIndexError, ("integer index", "float: stage=1.0", "stage=1"), "pass an int"),
    M("device-strings", "meshes", "`jit(f, devices=['cpu:0'])` (strings, not devices)",
      lambda env: mm.jit(_double, devices=["cpu:0"]),
      E.DevicePositionError, ("str: 'cpu:0'", "jax devices or integer positions", "range(4)"),
      "pass jax devices or integer positions"),
    M("device-position-range", "meshes", "`MultiMesh(devices=range(1, 9))` on 8 devices",
      lambda env: mm.MultiMesh(axis_sizes=(8,), axis_names=("x",), devices=range(1, 9)),
      E.MeshIndexError, ("Device position 8", "8 devices", "positions 0..7"),
      "use positions in `range(len(jax.devices()))`"),
    M("microbatch-wrong-argnum", "microbatching", "`microbatch(loss, 0, 2)` on `loss(params, "
      "batch)` (forgot `argnum=1`: the parameters are split)",
      lambda env: mm.jit(jax.grad(mm.microbatch(_chain(), 0, 2)))(env.ws, env.x),
      E.MicrobatchAxisError, ("`argnum`=0", "(4, 4), (4, 1)", "dot_general",
                              "wrong argument was split", "`argnum=1`"),
      "pass the batch's index as `argnum`"),
    M("microbatch-shards", "microbatching", "`microbatches=2` on a batch of 10 over 2 data "
      "shards (microbatches of 5)",
      lambda env: mm.parallelize_step(_DataNet(), optax.sgd(0.1), global_batch=jnp.ones((10, 4)),
                                      microbatches=2),
      E.UnevenShardingError, ("size 5", "2 shards", "microbatch 0 of 2 microbatches",
                              "Use fewer microbatches"),
      "use fewer microbatches or a batch that microbatches x shards divides"),
    M("shard-axes-rank", "Flax wrappers", "`shard_axes` with 3 names on a 2-D kernel",
      lambda env: mm.tabulate(_RankNet(), _key(), env.x),
      E.PartitionSpecError, ("shard_axes('embed', 'mlp', 'x')", "`Dense_0`", "shape (4, 4)",
                             "shard_axes('embed', 'mlp')"),
      "give one name (or None) per dimension"),
    M("step-restored-dict", "parallelize_step", "`step(ckpt.restore(), x)` (restored without "
      "`target=`: plain dicts)",
      lambda env: env.step(checkpoint.restore_checkpoint(env.state_ckpt), env.x),
      E.ParallelizeArgumentError, ("got a dict", "without `target=`", "restore(target=state)"),
      "restore with `target=state`", after=lambda env: env.check_step()),
    # Legitimate but usually a mistake: a PlacementWarning, raised as StrictModeError here.
    M("register-no-match", "registration", "a `register_task` pattern matching no name "
      "(`'layer([0-9])'` for scope `layer_0`), strict", lambda env: _strict(lambda: _in(
          _context_with("layer([0-9])", task=mm.Task(mesh=TM(devices=[1]))),
          lambda: mm.jit(_scoped_layer)(env.x))),
      E.StrictModeError, ("'layer([0-9])'", "matched no name", "Closest names: ['layer_0']",
                          "fix the pattern"),
      "fix the pattern (without strict mode: a `PlacementWarning`)"),
    M("register-inactive", "registration", "tasks registered on a MultiMesh never entered "
      "(`with multi:`), strict", lambda env: _strict(lambda: _outside(env)),
      E.StrictModeError, ("MultiMesh(stage=2, data=4)", "'layer_([0-9])'", "'layer_0'",
                          "not active", "with multi_mesh:"),
      "trace inside `with multi_mesh:` (without strict mode: a `PlacementWarning`)"),
    M("logical-name-no-rule", "logical rules", "`P('btach', None)` with a rule for `batch` "
      "only, strict", lambda env: _strict(lambda: mm.jit(mm.task(
          lambda x: mm.with_sharding_constraint(x, P("btach", None)), name="body",
          mesh=TM(devices=[0, 1], axis_names=("x",)), logical_axes=[("batch", "x")]))(env.x)),
      E.StrictModeError, ("'btach' has no rule", "'body'", "Closest rule names: ['batch']",
                          "('btach', None)"),
      "fix the name or add a rule (without strict mode: a `PlacementWarning`)"),
    M("task-under-jax-jit", "tasks", "a task traced by `jax.jit` instead of `mm.jit`, strict",
      lambda env: _strict(lambda: jax.jit(mm.task(_double, name="dbl", mesh=TM(devices=[1])))(
          env.x)),
      E.StrictModeError, ("'dbl'", "not placed", "`multimesh_flax.jit`"),
      "compile with `multimesh_flax.jit` (without strict mode: a `PlacementWarning`)"),
    M("nnx-task-instance", "Flax NNX", "`mm.task(nnx.Linear(2, 2, rngs=rngs), ...)` (an "
      "instance)",
      lambda env: mm.task(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), mesh=TM(devices=[0])),
      E.TaskTypeError, ("instance of Linear", "Pass the class"),
      "pass the class and construct the wrapped class"),
    M("nnx-unmapped-name", "Flax NNX", "a `Task[Block]` variable named `('embd', 'out')` with "
      "no rule for `embd`",
      lambda env: mm.task(nnx.Linear, mesh=TM(devices=[0, 1], axis_names=("x",)),
                          logical_axes=[("out", "x")])(
          3, 4, kernel_init=nnx.with_partitioning(nnx.initializers.ones, ("embd", "out")),
          rngs=nnx.Rngs(0)),
      E.UnmappedLogicalAxisError, ("'embd'", "'kernel'", "Add a rule to `logical_axes`"),
      "add a rule: `(name, None)` to replicate, `(name, axis)` to shard"),
    M("nnx-eager-no-mesh", "Flax NNX", "a `Task[Block]` variable with `eager_sharding=True` "
      "and no mesh set",
      lambda env: mm.task(_EagerNNX, mesh=TM(devices=[0, 1], axis_names=("x",)))(nnx.Rngs(0)),
      E.UnplacedVariableError, ("eager_sharding=True", "Drop eager_sharding=True"),
      "drop `eager_sharding=True` or construct it inside `jax.set_mesh`"),
    M("nnx-optimizer-other-model", "Flax NNX", "`mm.jit(step)(model, optimizer, x)` with an "
      "`nnx.Optimizer` built for another model",
      lambda env: mm.jit(_nnx_step)(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), nnx.Optimizer(
          nnx.Linear(3, 3, rngs=nnx.Rngs(0)), optax.adam(0.1), wrt=nnx.Param), env.x),
      E.GraphArgumentError, ("(Linear)", "built for another model",
                             "nnx.Optimizer(model, tx, wrt=nnx.Param)"),
      "build the optimizer from the model it trains"),
    M("nnx-jit-returns-module", "Flax NNX", "a function under `mm.jit` returning an NNX module",
      lambda env: mm.jit(lambda m, x: (m, m(x)))(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), env.x),
      E.GraphArgumentError, ("returned an NNX graph object (Linear)", "return arrays"),
      "return arrays; graph objects passed in are updated in place"),
    # --- issue 39: planning ---
    M("plan-pattern-none", "planning", "`profile_units` with a pattern that matches no "
      "submodule", lambda env: mm.profile_units(nn.Dense(4), env.x, patterns=["block"]),
      E.UnitPatternError, ("'block'", "matched none", "module paths"),
      "use the module paths `tabulate` shows"),
    M("plan-mesh-too-large", "planning", "`profile_units` on a 16-device `mesh_shape` with 8 "
      "devices", lambda env: mm.profile_units(nn.Dense(4), env.x, patterns=["Dense_0"],
                                              mesh_shape={"data": 16}),
      E.ProfileArgumentError, ("{'data': 16}", "Profile on a smaller submesh"),
      "profile on a smaller submesh; `predict` scales to the plan's"),
    M("plan-uneven-microbatches", "planning", "a `Plan` whose `microbatches` (4) do not "
      "divide its `batch_size` (6)",
      lambda env: mm.predict(mm.Plan((1, 1), microbatches=4, batch_size=6), _stack_profile(env)),
      E.UnevenMicrobatchError, ("batch of 6", "got 4", "Pick a divisor of 6"),
      "pick a divisor of the batch, or change `batch_size`"),
    M("plan-split-mismatch", "planning", "a `Plan` splitting 3 blocks of a 2-block profile",
      lambda env: mm.predict(mm.Plan((1, 2)), _stack_profile(env)),
      E.PlanMismatchError, ("2 blocks", "(1, 2)", "Change the counts"),
      "change the counts, or profile the model the plan is for"),
    M("plan-nothing-fits", "planning", "`mm.plan` with 100 bytes per device",
      lambda env: mm.plan(None, None, env.x, devices=2, memory_per_device=100,
                          profile=_stack_profile(env)),
      E.PlanMemoryError, ("(100 B)", "least memory per device", "Give at least that"),
      "give at least the memory named, or widen the search"),
    M("plan-interleaved", "planning", "`mm.plan` searching `'interleaved-1f1b'`",
      lambda env: mm.plan(None, None, env.x, devices=2, schedules="interleaved-1f1b",
                          profile=_stack_profile(env)),
      E.PlanArgumentError, ("'interleaved-1f1b'", "one stage per submesh"),
      "search a schedule with one stage per submesh; price an interleaved one with `predict`"),
]


class _Stack(nn.Module):
    """Two Dense layers named ``layer_0`` and ``layer_1``: two identical planner units."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="layer_1")(nn.Dense(4, name="layer_0")(x))


def _stack_profile(env):
    """An analytic profile of `_Stack` (made once)."""
    if not hasattr(env, "stack_profile"):
        env.stack_profile = mm.profile_units(_Stack(), jnp.ones((8, 4)), patterns=[r"layer_\d"])
    return env.stack_profile
# fmt: on


class _EagerNNX(nnx.Module):
    """An NNX module whose variable asks NNX to shard it at creation (needs a mesh)."""

    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.ones, ("x",), eager_sharding=True)
        self.w = nnx.Param(init(rngs.params(), (4,)))


def _nnx_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss


def _strict(fun):
    with mm.context(strict=True):
        return fun()


def _scoped_layer(x):
    with jax.named_scope("layer_0"):
        return x * 2


def _outside(env):
    multi = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    multi.register_task(
        "layer_([0-9])", callback=lambda name, backprop: mm.Task(mesh_slice={"stage": int(name)})
    )
    return mm.jit(_scoped_layer)(env.x)  # not inside `with multi:`


def _data_file(env: Env, name: str, content: bytes) -> Path:
    """A ``--dataset`` file (made once, beside ``env.root``) holding ``content``."""
    path = env.root.parent / "datasets" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return path


def _foreign_run(env: Env) -> Path:
    """A run folder (made once, beside ``env.root``) whose checkpoint has other metadata."""
    folder = env.root.parent / "foreign-run"
    if not folder.exists():
        checkpoint.save_checkpoint(folder / "checkpoint", 1, env.saved, metadata={"lr": 0.1})
    return folder


def _widened(state):
    """``state`` with every parameter one column wider: a state made for another model."""
    wider = lambda x: jnp.zeros((*x.shape[:-1], x.shape[-1] + 1), x.dtype)
    return state.replace(params=jax.tree.map(wider, state.params))


def _step_twice(env):
    """``loss, new = step(state, x)`` and again with the same (consumed) ``state``."""
    old = env.state
    _, env.state = env.step(old, env.x)
    env.step(old, env.x)


def _donate_twice(env):
    donating = mm.jit(lambda x: x * 2, donate_argnums=0)
    x = jnp.ones((8, 4)) + 0  # a fresh array the first call consumes
    donating(x)
    donating(x)


def _donate_aliased(env):
    x = env.x + 0  # a fresh array: the mistake must leave it alive
    try:
        mm.jit(lambda a, b: a + b, donate_argnums=0)(x, x)
    finally:
        assert not x.is_deleted()


class _BatchDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(mm.with_sharding_constraint(x, P("batch", None)))


class _DataNet(nn.Module):
    """A task whose batch shards over 2 devices (rule ``batch -> x``)."""

    @nn.compact
    def __call__(self, x):
        dense = mm.layers.task(
            _BatchDense, mesh=TM(devices=[0, 1], axis_names=("x",)), logical_axes=[("batch", "x")]
        )
        return (dense()(x) ** 2).mean()


class _RankNet(nn.Module):
    """A Dense task whose kernel is given three logical names."""

    @nn.compact
    def __call__(self, x):
        dense = mm.layers.task(nn.Dense, mesh=TM(devices=[0, 1], axis_names=("x",)))
        return dense(4, kernel_init=mm.shard_axes("embed", "mlp", "x"))(x)


def _save_into(env):
    ckpt = checkpoint.Checkpointer(env.ckpt, read_only=True)
    try:
        ckpt.save(2, env.saved)
    finally:
        ckpt.close()


def _context_with(matcher, **kwargs):
    ctx = mm.Context()
    ctx.register_task(matcher, **kwargs)
    return ctx


def _models():
    import models
    import models.pipeline  # noqa: F401

    return models


_HF = Path(__file__).resolve().parent / "fixtures" / "hf"


def _hf():
    import models.hf

    return models.hf


def _hf_folder(env: Env, kind: str) -> Path:
    """A broken copy of a fixture checkpoint, made once, beside (not inside) ``env.root``."""
    folder = env.root.parent / f"hf-{kind}"
    if folder.exists():
        return folder
    source = "llama" if kind in ("truncated", "odd-vocab", "architecture") else "gpt2"
    if kind == "odd-vocab":
        config, params = _hf().load(_HF / source)
        return _hf().save(folder, config, params, vocab_size=319)
    shutil.copytree(_HF / source, folder)
    config = json.loads((folder / "config.json").read_text())
    if kind == "no-config":
        (folder / "config.json").unlink()
        return folder
    if kind == "truncated":
        shard = folder / "model-00003-of-00006.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])
        return folder
    if kind in ("non-finite", "int-tensor"):
        _break_tensor(folder / "model.safetensors", "transformer.h.1.mlp.c_fc.weight", kind)
        return folder
    changes = {
        "architecture": {
            "architectures": ["GemmaForCausalLM"],
            "model_type": "gemma",
            "hidden_activation": "gelu_pytorch_tanh",
        },
        "missing-tensor": {"n_layer": 5},
        "extra-tensor": {"n_layer": 2},
        "shape": {"n_positions": 32},
    }[kind]
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def _break_tensor(path: Path, key: str, kind: str) -> None:
    """Rewrites tensor ``key`` of ``path``: 3 values inf (``non-finite``) or int32 ones."""
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(str(path))
    array = tensors[key]
    if kind == "non-finite":
        tensors[key] = np.where(np.arange(array.size).reshape(array.shape) < 3, np.inf, array)
    else:
        tensors[key] = np.ones(array.shape, np.int32)
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})


def _nonfinite_step(env: Env, batch: Any = None) -> None:
    """A step built with ``nonfinite='raise'`` (once), called on a NaN batch (or ``batch``);
    the error's unchanged state replaces the donated one, so the same mistake is repeatable."""
    if not hasattr(env, "raising"):
        env.raising = mm.parallelize_step(_Net(), optax.sgd(0.1), global_batch=env.x,
                                          nonfinite="raise")[:2]  # fmt: skip
    step, state = env.raising
    try:
        _, state = step(state, env.x * jnp.nan if batch is None else batch)
    except errors.NonFiniteError as error:
        state = error.state
        raise
    finally:
        env.raising = (step, state)


# --- state snapshots ------------------------------------------------------------------------


def _tree_digest(root: Path) -> dict[str, str]:
    digest = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        digest[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "<dir>"
    return digest


def _snapshot(env: Env) -> dict[str, Any]:
    contexts = _registry.active_contexts()
    registries = {*contexts, env.multi, env.context}
    return {
        "flags": {n: _config.get_flag(n) for n in _config._NAMES},
        "multi_meshes": list(_thread.STATE.multi_meshes),
        "device_lists": list(_thread.STATE.device_lists),
        "task_stack": list(_thread.STATE.task_stack),
        "trace_sessions": list(_thread.STATE.sessions),
        "microbatch_index": _thread.STATE.microbatch_index,
        "shape_only": _thread.STATE.shape_only,
        "active_contexts": contexts,
        "registrations": {id(c): (c.registrations, c._version) for c in registries},
        "flax_task_stack": list(_thread.STATE.flax_rules),
        "flax_path_recorders": list(_flax_task._RECORDER.owners),
        "timeline": _thread.STATE.timeline,
        "abstract_mesh": jax.sharding.get_abstract_mesh(),
        "logical_axis_rules": nn.get_logical_axis_rules(),
        "name_stack": str(source_info_util.current_name_stack()),
        "jax_config": (jax.config.jax_platforms, jax.config.jax_num_cpu_devices),
        "cwd": os.getcwd(),
        "files": _tree_digest(env.root),
    }


def _message(error: BaseException) -> str:
    return re.sub(r"0x[0-9a-f]+", "0x...", str(error))


# --- tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return Env(tmp_path_factory.mktemp("bad_inputs"))


def _says(message: str, fragment: str, command_line: bool) -> bool:
    """``fragment`` is in ``message``; on the command line a choice may come unquoted
    (argparse on Python 3.13 writes "choose from demo, train", 3.11 "'demo', 'train'")."""
    return fragment in message or (command_line and fragment.replace("'", "") in message)


@pytest.mark.parametrize("mistake", CATALOGUE, ids=lambda m: m.id)
def test_mistake(mistake, env):
    before = _snapshot(env)
    with pytest.raises(mistake.error) as first:
        mistake.call(env)
    error = first.value
    assert type(error) is mistake.error, f"{type(error).__name__}: {error}"
    if mistake.error is not CommandLineExit:
        assert isinstance(error, errors.MultiMeshError)
        assert isinstance(error, (ValueError, TypeError))
    cli = mistake.error is CommandLineExit
    missing = [f for f in mistake.fragments if not _says(str(error), f, cli)]
    assert not missing, f"message lacks {missing}: {error}"
    assert _snapshot(env) == before

    with pytest.raises(mistake.error) as again:  # the same mistake: the same message
        mistake.call(env)
    assert _message(again.value) == _message(error)
    assert _snapshot(env) == before
    env.check_canary()
    if mistake.after is not None:
        mistake.after(env)


def test_catalogue_covers_every_area():
    ids = [m.id for m in CATALOGUE]
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert len(CATALOGUE) >= 45
    areas = {m.area for m in CATALOGUE}
    assert areas >= {
        "meshes", "tasks", "logical rules", "registration", "microbatching", "schedules",
        "Flax wrappers", "parallelize_step", "jit/parallelize", "checkpoints", "CLI",
    }  # fmt: skip
    for m in CATALOGUE:
        assert len(m.fragments) >= 1 and m.mistake and m.fix, m.id


def render_table() -> str:
    """The catalogue as the Markdown table that ``docs/errors.md`` holds."""
    lines = [
        "| id | area | mistake | error | the message says to |",
        "|---|---|---|---|---|",
    ]
    for m in CATALOGUE:
        name = "exit status 2" if m.error is CommandLineExit else f"`{m.error.__name__}`"
        cells = (f"`{m.id}`", m.area, m.mistake, name, m.fix)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def _docs_table(text: str) -> str:
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def test_docs_list_the_catalogue():
    text = DOCS.read_text()
    for m in CATALOGUE:
        assert f"`{m.id}`" in text, f"{m.id} is missing from docs/errors.md"
    assert _docs_table(text) == render_table(), (
        "docs/errors.md is out of date: run `python tests/test_bad_inputs.py`"
    )


if __name__ == "__main__":  # regenerates the table in docs/errors.md
    text = DOCS.read_text()
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    DOCS.write_text(f"{head}{START}\n{render_table()}\n{END}{tail}")
    print(f"wrote {len(CATALOGUE)} mistakes to {DOCS}", file=sys.stderr)
