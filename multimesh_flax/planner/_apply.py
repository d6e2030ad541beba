"""A plan turned into what a user trains with: `AppliedPlan`.

`Prediction.apply()` gives an `AppliedPlan` holding every choice of the plan in the form the
runtime takes it:

* the ``MultiMesh``: a ``stage`` axis of the stage count, then the profiled mesh axes with
  the plan's data and tensor sizes (`make_mesh`);
* the arguments of ``parallelize_step``: ``microbatches``, ``schedule`` and (when every
  stage recomputes alike) ``recompute`` (`step_kwargs`);
* for the reference models (`models.GPT`, `models.Llama`), ``layers_per_stage``
  (`configure` returns the model split so);
* for any other model, a ``register_task`` placement per unit, by module path: the unit's
  stage as ``mesh_slice={"stage": s}``, the profile's logical rules, the stage's
  recomputation (`tasks`; `register` registers them on the ``MultiMesh`` or the active
  ``Context``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn

from multimesh_flax import errors
from multimesh_flax.core import Context, MultiMesh, Task, register_task

STAGE_AXIS = "stage"


@dataclasses.dataclass(frozen=True)
class AppliedPlan:
    """The arguments that run a plan.

    Attributes:
        layers_per_stage: Blocks per stage (the reference models' ``layers_per_stage``).
        mesh_axes: ``((name, size), ...)`` of the ``MultiMesh``: ``("stage", S)`` first.
        step_kwargs: Keyword arguments of ``parallelize_step``: ``microbatches``,
            ``schedule``, ``recompute``.
        tasks: Per unit ``(module path, stage, recompute policy)``.
        rules: The logical rules of every task.

    Example:
        >>> from multimesh_flax.planner import AppliedPlan
        >>> applied = AppliedPlan((1, 3), (("stage", 2), ("data", 2), ("model", 2)),
        ...                       {"microbatches": 4, "schedule": "1f1b", "recompute": None},
        ...                       (("layer_0", 0, None), ("layer_1", 1, None)), ())
        >>> dict(applied.make_mesh().shape)
        {'stage': 2, 'data': 2, 'model': 2}
    """

    layers_per_stage: tuple[int, ...]
    mesh_axes: tuple[tuple[str, int], ...]
    step_kwargs: dict[str, Any]
    tasks: tuple[tuple[str, int, str | None], ...]
    rules: tuple = ()

    @classmethod
    def from_prediction(cls, prediction: Any) -> AppliedPlan:
        """The `AppliedPlan` of a `Prediction` (from `predict` or `plan`)."""
        plan = prediction.plan
        meshes = prediction.stage_meshes or plan.stage_meshes()
        if any(m != meshes[0] for m in meshes) or not meshes[0]:
            raise errors.PlanMismatchError(
                f"Expected one submesh shape for every stage to build a MultiMesh, got "
                f"{meshes}. Give `stage_mesh` one shape."
            )
        policies = plan.policies()
        uniform = len(set(policies)) == 1
        kwargs = {
            "microbatches": plan.microbatches,
            "schedule": plan.schedule,
            "recompute": policies[0] if uniform else None,
        }
        tasks = tuple(
            (path, s, policies[s])
            for s, paths in enumerate(prediction.stage_paths)
            for path in paths
        )
        axes = ((STAGE_AXIS, plan.num_stages), *meshes[0].items())
        return cls(tuple(plan.layers_per_stage), axes, kwargs, tasks, prediction.rules)

    @property
    def device_count(self) -> int:
        """The devices the plan runs on."""
        return math.prod(size for _, size in self.mesh_axes)

    @property
    def uniform_recompute(self) -> bool:
        """Whether every stage recomputes alike (``parallelize_step`` can then apply it)."""
        return len({policy for _, _, policy in self.tasks}) <= 1

    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> MultiMesh:
        """The ``MultiMesh`` over ``devices`` (default: the first ``device_count`` devices).

        Raises:
            MeshShapeError: fewer devices than the plan needs.
        """
        pool = list(jax.devices() if devices is None else devices)
        if len(pool) < self.device_count:
            raise errors.MeshShapeError(
                f"Expected at least the plan's {self.device_count} devices "
                f"({dict(self.mesh_axes)}), got {len(pool)}. Run where they are, or plan "
                "for fewer devices."
            )
        sizes = tuple(size for _, size in self.mesh_axes)
        grid = np.array(pool[: self.device_count], dtype=object).reshape(sizes)
        return MultiMesh(
            devices=grid, axis_sizes=sizes, axis_names=tuple(n for n, _ in self.mesh_axes)
        )

    def configure(self, model: nn.Module) -> nn.Module:
        """A reference model (``models.GPT``/``Llama``) split as planned.

        Raises:
            PlanMismatchError: ``model`` takes no ``layers_per_stage``, or the stages
                recompute differently (``parallelize_step`` applies one policy to them:
                plan with ``per_stage_recompute=False``).
        """
        if not hasattr(model, "layers_per_stage"):
            raise errors.PlanMismatchError(
                f"Expected a reference model with a `layers_per_stage` field, got "
                f"{type(model).__name__}. For your own model, `register()` the plan's "
                "placements by module path."
            )
        if not self.uniform_recompute:
            raise errors.PlanMismatchError(
                f"Expected one recomputation policy for every stage of a reference model, got "
                f"{[p for _, _, p in self.tasks]}. Plan with `per_stage_recompute=False`, or "
                "`register()` the placements."
            )
        return model.clone(stages=None, layers_per_stage=self.layers_per_stage)

    def task_of(self, stage: int, policy: str | None) -> Task:
        """The ``Task`` of a unit on ``stage`` recomputing as ``policy``."""
        return Task(
            mesh_slice={STAGE_AXIS: stage},
            logical_axes=self.rules or None,
            recompute=policy,
        )

    def register(self, registry: Context | None = None) -> None:
        """Registers every unit's task by module path: ``register_task(re.escape(path),
        task=...)`` on ``registry`` (a ``Context``, e.g. the ``MultiMesh`` of `make_mesh`)
        or, with ``None``, in the innermost active ``Context``."""
        add = register_task if registry is None else registry.register_task
        for path, stage, policy in self.tasks:
            add(re.escape(path), task=self.task_of(stage, policy))
