"""``PipelineOptions``: how a microbatched computation is split and ordered, one record for
``parallelize_step(pipeline=...)`` and ``microbatch(..., pipeline=...)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from multimesh_flax import errors
from multimesh_flax.core.declare._costs import CostFn


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How a batch is split into microbatches and how their pipeline units are ordered.

    Attributes:
        microbatches: how many microbatches each batch is split into. ``parallelize_step``
            pipelines only with a count; ``microbatch`` takes it instead of a ``size``.
        schedule: the schedule name (``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``,
            ``"zero-bubble-h1"``, ``"zero-bubble-h2"``, ``"zero-bubble-auto"``,
            ``"zero-bubble-v"``, ``"custom"``), or ``None`` for program order.
        interleave: stages per submesh, for ``"interleaved-1f1b"``.
        custom_schedule: one sequence of ops per submesh, for ``"custom"`` (implies it).
        costs: per-phase or per-stage costs (as ``simulate`` takes them) that
            ``"zero-bubble-auto"`` and ``"zero-bubble-v"`` order for; default unit costs.
        max_in_flight: activation sets a submesh may hold, for ``"zero-bubble-auto"`` and
            ``"zero-bubble-v"`` (default: 1F1B's).
        w_memory: for those two, the share of an activation set kept from its ``B`` to its
            ``W`` (the Zero Bubble paper's ``M_W / M_B``); ``max_in_flight`` counts a set
            waiting for its ``W`` as this share. Default: a whole set.
        num_stages: the expected number of stages (checked against the tasks found).

    Example:
        >>> import multimesh_flax as mm
        >>> options = mm.PipelineOptions(microbatches=8, schedule="zero-bubble-auto",
        ...                              costs={"F": 1.0, "B": 1.0, "W": 0.5})
        >>> options.schedule, options.microbatches
        ('zero-bubble-auto', 8)
    """

    microbatches: int | None = None
    schedule: str | None = None
    interleave: int | None = None
    custom_schedule: Sequence[Sequence[Any]] | None = None
    costs: Mapping[str, float] | CostFn | None = None
    max_in_flight: int | None = None
    num_stages: int | None = None
    w_memory: float | None = None


def pipeline_options(
    pipeline: PipelineOptions | None,
    keywords: dict[str, Any],
    owner: str,
    error: type[Exception] = errors.MicrobatchArgumentError,
) -> PipelineOptions:
    """``pipeline``, or a record of the schedule ``keywords`` ``owner`` was given one by one
    (``None`` values are the defaults); both at once raises ``error``."""
    given = {name: value for name, value in keywords.items() if value is not None}
    if pipeline is None:
        return PipelineOptions(**given)
    if not isinstance(pipeline, PipelineOptions):
        raise error(
            f"Expected `pipeline` to be a PipelineOptions, got {type(pipeline).__name__}: "
            f"{pipeline!r}. Build one with `mm.PipelineOptions(microbatches=..., "
            "schedule=...)`."
        )
    if given:
        raise error(
            f"{owner} got `pipeline` and also {sorted(given)}. Pass the options in one place: "
            f"`pipeline=dataclasses.replace(pipeline, {next(iter(sorted(given)))}=...)`, or "
            "the keywords without `pipeline`."
        )
    return pipeline
