"""The plan pass: microbatches, pipeline units and schedules, and sums in schedule order.

:func:`plan_program` is the stage's one pass over a traced program: ``_pipeline.analyze``
gives every equation's record its microbatch and unit and builds each region's schedule;
under a schedule ``_accumulate.reassociate_sums`` puts sums over microbatches in the order
their operands are predicted to be ready; ``_accumulate.bundle_sums`` makes each
microbatch's additions of one block's gradients one equation. Each step returns a new
program and plan.
"""

from __future__ import annotations

from multimesh_flax.core.plan import _accumulate, _pipeline
from multimesh_flax.core.trace import TracedProgram


def plan_program(
    traced: TracedProgram,
) -> tuple[TracedProgram, _pipeline.PipelinePlan | None]:
    """The *plan* pass: the program with every equation's microbatch and unit, and its plan
    (``None``, and the program as it is, without microbatching).

    Raises:
        InvalidScheduleError: a region's schedule does not fit its stages.
    """
    analyzed = _pipeline.analyze(traced)
    if analyzed is None:
        return traced, None
    traced, plan = analyzed
    if plan.scheduled:
        traced, plan = _accumulate.reassociate_sums(traced, plan)
    return _accumulate.bundle_sums(traced, plan)
