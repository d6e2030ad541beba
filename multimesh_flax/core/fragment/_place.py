"""Placement: one submesh (*place*, its device ids) per equation of a planned program.

* task equations go to their task's submesh;
* glue equations (loss, gradient sums, optimizer updates) go where most of their input bytes
  were produced; glue with no produced inputs (constants, input preprocessing) goes to its
  first consumer; glue with neither goes to the first task's submesh (or the one registered
  as ``"default"``);
* a glue ``with_sharding_constraint`` onto a task's submesh runs there (``_pinned_place``).

Program inputs go to their first consumer (a parameter lives where its task uses it); that
is decided with the fragments (``_partition.make_partition``), from the consumer index
built here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from multimesh_flax.core.declare import (
    Place,
    get_device_list,
    make_auto_mesh,
    place_of,
    use_device_list,
)
from multimesh_flax.core.plan import PipelinePlan
from multimesh_flax.core.trace import Equation, TracedProgram, concrete_constraint


def aval_nbytes(aval: Any) -> int:
    """The bytes of a value of type ``aval`` (Python integers: no overflow, no NumPy call)."""
    return math.prod(aval.shape) * aval.dtype.itemsize


def nbytes(var: Any) -> int:
    """The bytes of a variable's value."""
    return aval_nbytes(var.aval)


@dataclasses.dataclass(frozen=True)
class PlacedProgram:
    """A planned program whose every equation record has its ``place``: what cutting,
    arranging and fusing read."""

    traced: TracedProgram
    plan: PipelinePlan | None  # microbatches, stages, schedules; ``None``: no microbatching
    meshes: dict[Place, jax.sharding.Mesh]  # the tasks' meshes and the default one
    default_place: Place
    users: dict[Any, list[int]]  # variable -> the equations reading it, in program order


def place_program(
    traced: TracedProgram, plan: PipelinePlan | None, devices: Any = None
) -> PlacedProgram:
    """The *place* pass: every equation's record with its place (see module doc).

    ``devices`` is the executable's device list: glue with nothing to follow runs on all of
    them when no task says otherwise.
    """
    meshes, default = _place_meshes(traced, devices)
    users = _consumers(traced.jaxpr)  # the one consumer index of this program
    places = _place_equations(traced, default, users)
    equations = tuple(
        Equation(e.eqn, e.stack, e.label, e.microbatch, e.unit, e.mixed, place)
        for e, place in zip(traced.equations, places, strict=True)
    )
    placed = dataclasses.replace(traced, equations=equations)
    if plan is not None:
        plan = dataclasses.replace(plan, equations=equations)
    return PlacedProgram(placed, plan, meshes, default, users)


def _consumers(jaxpr: Any) -> dict[Any, list[int]]:
    users: dict[Any, list[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jex.Literal):
                users.setdefault(v, []).append(i)
    return users


def _place_meshes(traced: TracedProgram, devices: Any) -> tuple[dict[Place, Any], Place]:
    meshes: dict[Place, Any] = {}
    for resolved in traced.tasks.values():
        meshes.setdefault(place_of(resolved.mesh), resolved.mesh)
    with use_device_list(devices):
        pool = np.array(get_device_list(), dtype=object)
    everything = make_auto_mesh(pool, ("devices",))
    first = next(
        (traced.tasks[e.label.task].mesh for e in traced.equations if e.label is not None), None
    )
    if traced.default_task is not None:  # a task registered as "default" says where
        first = traced.default_task.mesh
    default_mesh = first if first is not None else everything
    meshes.setdefault(place_of(default_mesh), default_mesh)
    return meshes, place_of(default_mesh)


def _pinned_place(eqn: Any, task_places: set[Place]) -> Place | None:
    """The place a glue sharding constraint names, if it is a task's submesh.

    ``with_sharding_constraint(x, NamedSharding(stage_mesh, spec))`` outside every task (e.g.
    a training step keeping its new state where the old one was) runs on that submesh, so
    the value ends up there; placed by its producer instead, the constraint would only fix
    the layout and the value would stay on the producer's devices.
    """
    sharding = concrete_constraint(eqn)
    if sharding is None:
        return None
    place = place_of(sharding.mesh)
    return place if place in task_places else None


def _place_equations(
    traced: TracedProgram, default: Place, users: dict[Any, list[int]]
) -> list[Place]:
    """Each equation's place, in program order (see module doc)."""
    eqns = traced.jaxpr.eqns
    of_task = {uid: place_of(resolved.mesh) for uid, resolved in traced.tasks.items()}
    places: list[Place | None] = [
        None if e.label is None else of_task[e.label.task] for e in traced.equations
    ]
    producer = traced.producer
    task_places = set(of_task.values())
    for i, eqn in enumerate(eqns):  # glue: where most produced input bytes live
        if places[i] is not None:
            continue
        places[i] = _pinned_place(eqn, task_places)
        if places[i] is not None:
            continue
        weight: dict[Place, int] = {}
        for v in eqn.invars:
            src = None if isinstance(v, jex.Literal) else producer.get(v)
            if src is not None and places[src] is not None:
                weight[places[src]] = weight.get(places[src], 0) + nbytes(v) + 1
        if weight:
            places[i] = max(weight, key=weight.__getitem__)
    for i in reversed(range(len(eqns))):  # remaining glue: at its first consumer
        if places[i] is None:
            after = sorted(u for v in eqns[i].outvars for u in users.get(v, ()))
            placed = [places[u] for u in after if places[u] is not None]
            places[i] = placed[0] if placed else default
    return places  # type: ignore[return-value]
