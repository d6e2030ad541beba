"""The best contiguous split of a model's blocks over pipeline stages: a dynamic program.

For one *configuration* -- stage count ``S``, submesh shape, schedule, microbatch count
``m``, rows per microbatch -- `best_split` chooses the blocks of every stage and the
recomputation policy of every stage. It minimises the pipeline's classic cost model (Alpa,
OSDI'22, Eq. 2)::

    sum over stages of t_s  +  (m - 1) * max over stages of t_s

where ``t_s`` is stage ``s``'s forward + backward time per microbatch (`StageTables`), subject
to every stage's peak bytes per device fitting ``memory``: the larger of (parameters,
optimizer state, two gradients' worth + the schedule's in-flight activation sets at that
stage x its activation bytes) and the optimizer update's moment (old and new state, two
gradients' worth), plus its largest temporary -- a close bound of `predict`'s peak, which
then checks the plans found.

How: for a bound ``t_max`` on the slowest stage, a stage ``[i, j)`` of blocks costs the
fastest time among the policies that fit memory and stay under ``t_max`` (infinite if none),
and ``f_s(j) = min_i f_{s-1}(i) + cost_s(i, j)`` gives the least sum of stage times (numpy,
``O(S L^2)`` per bound). The bounds tried are the distinct stage times, from the smallest
feasible one (binary search: feasibility only grows with the bound) upwards, stopping once
``(m - 1) * t_max + (the least sum without a bound)`` cannot beat the best found.
`min_peak_split` solves the other question -- the least memory any split needs -- with the
min-max form of the same recursion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

INF = np.inf


@dataclasses.dataclass(frozen=True)
class StageTables:
    """Per stage position and policy, the time and peak bytes of every block interval.

    ``time[s, p, i, j]`` and ``peak[s, p, i, j]``: stage ``s`` holding blocks ``i .. j - 1``
    under policy ``p`` (infinite where the interval is not allowed: ``i > j``, or empty on a
    stage that holds neither the stem nor the head).
    """

    time: np.ndarray
    peak: np.ndarray
    policies: tuple[str | None, ...]

    @property
    def num_stages(self) -> int:
        return self.time.shape[0]

    @property
    def num_layers(self) -> int:
        return self.time.shape[-1] - 1


@dataclasses.dataclass(frozen=True)
class Split:
    """A dynamic program's answer: blocks and policy per stage, and its cost model value."""

    layers_per_stage: tuple[int, ...]
    policies: tuple[str | None, ...]
    objective: float
    slowest: float


def _fitting(tables: StageTables, memory: float) -> np.ndarray:
    """Stage times with every interval and policy that does not fit ``memory`` infinite."""
    return np.where(tables.peak <= memory, tables.time, INF)


def _least_sum(cost: np.ndarray) -> float:
    """The least sum of stage costs over contiguous splits (``cost[s, i, j]``)."""
    best = cost[0, 0]
    for s in range(1, cost.shape[0]):
        best = (best[:, None] + cost[s]).min(axis=0)
    return float(best[-1])


def _solve(cost: np.ndarray) -> tuple[float, list[int]]:
    """The least sum of stage costs over contiguous splits, and the split's boundaries."""
    stages, size = cost.shape[0], cost.shape[-1]
    best = cost[0, 0].copy()
    choice = np.zeros((stages, size), dtype=int)
    for s in range(1, stages):
        total = best[:, None] + cost[s]
        choice[s] = total.argmin(axis=0)
        best = total[choice[s], np.arange(size)]
    bounds = [size - 1]
    for s in range(stages - 1, 0, -1):
        bounds.append(int(choice[s, bounds[-1]]))
    return float(best[-1]), [0, *reversed(bounds)]


def _bounded(fitting: np.ndarray, bound: float) -> np.ndarray:
    """Per stage and interval, the fastest fitting policy's time if within ``bound``."""
    return np.where(fitting <= bound, fitting, INF).min(axis=1)


def _answer(tables: StageTables, fitting: np.ndarray, bound: float, m: int) -> Split | None:
    bounded = np.where(fitting <= bound, fitting, INF)
    cost, which = bounded.min(axis=1), bounded.argmin(axis=1)
    total, bounds = _solve(cost)
    if not np.isfinite(total):
        return None
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    times = [cost[s, i, j] for s, (i, j) in enumerate(spans)]
    policies = tuple(tables.policies[which[s, i, j]] for s, (i, j) in enumerate(spans))
    slowest = max(times)
    return Split(
        tuple(j - i for i, j in spans), policies, total + (m - 1) * slowest, float(slowest)
    )


def best_split(tables: StageTables, microbatches: int, memory: float = INF) -> Split | None:
    """The split and policies minimising ``sum t_s + (m - 1) max t_s`` within ``memory``.

    Returns ``None`` when no split fits.

    Example:
        >>> import numpy as np
        >>> from multimesh_flax.planner._split import tables_from_arrays, best_split
        >>> tables = tables_from_arrays(  # 4 blocks, the last one 3x slower; 2 stages
        ...     np.array([[1.0, 1.0, 1.0, 3.0]]), np.zeros((1, 4)), np.zeros(4), num_stages=2)
        >>> best_split(tables, microbatches=4).layers_per_stage
        (3, 1)
    """
    fitting = _fitting(tables, memory)
    bounds = np.unique(fitting[np.isfinite(fitting)])
    unbounded = _least_sum(fitting.min(axis=1))
    if not np.isfinite(unbounded):
        return None
    lo, hi = 0, bounds.size - 1  # the smallest feasible bound: feasibility grows with it
    while lo < hi:
        mid = (lo + hi) // 2
        if np.isfinite(_least_sum(_bounded(fitting, bounds[mid]))):
            hi = mid
        else:
            lo = mid + 1
    m = microbatches
    best_value, best_bound = INF, INF
    for bound in bounds[lo:]:
        if (m - 1) * bound + unbounded >= best_value:
            break
        value = _least_sum(_bounded(fitting, bound)) + (m - 1) * bound
        if value < best_value:
            best_value, best_bound = value, bound
    return _answer(tables, fitting, best_bound, m)


def min_peak_split(tables: StageTables) -> tuple[float, Split]:
    """The least peak bytes per device any split (and choice of policies) needs, and it."""
    peak = tables.peak.min(axis=1)
    which = tables.peak.argmin(axis=1)
    stages, size = peak.shape[0], peak.shape[-1]
    best = peak[0, 0].copy()
    choice = np.zeros((stages, size), dtype=int)
    for s in range(1, stages):
        worst = np.maximum(best[:, None], peak[s])
        choice[s] = worst.argmin(axis=0)
        best = worst[choice[s], np.arange(size)]
    bounds = [size - 1]
    for s in range(stages - 1, 0, -1):
        bounds.append(int(choice[s, bounds[-1]]))
    bounds = [0, *reversed(bounds)]
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    policies = tuple(tables.policies[which[s, i, j]] for s, (i, j) in enumerate(spans))
    split = Split(tuple(j - i for i, j in spans), policies, INF, INF)
    return float(best[-1]), split


def _interval_sums(values: np.ndarray) -> np.ndarray:
    """``out[i, j] = values[i:j].sum()`` (0 for ``i >= j``)."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return np.maximum(prefix[None, :] - prefix[:, None], 0.0)


def _interval_max(values: np.ndarray) -> np.ndarray:
    """``out[i, j] = values[i:j].max()`` (0 for ``i >= j``)."""
    size = values.size + 1
    out = np.zeros((size, size))
    for i in range(values.size):
        out[i, i + 1 :] = np.maximum.accumulate(values[i:])
    return out


@dataclasses.dataclass(frozen=True)
class Intervals:
    """Per policy, the summed time and activation bytes and the largest temporary of every
    block interval ``[i, j)``, and its state bytes (`interval_arrays`)."""

    time: np.ndarray
    activation: np.ndarray
    temp: np.ndarray
    state: np.ndarray
    update: np.ndarray | None = None
    fused: np.ndarray | None = None


def interval_arrays(
    time: np.ndarray,
    activation: np.ndarray,
    state: np.ndarray,
    temp: np.ndarray,
    update: np.ndarray | None = None,
    fused: np.ndarray | None = None,
    summed_temp: Sequence[bool] | None = None,
) -> Intervals:
    """`Intervals` of per-block arrays (``[policy, block]``; ``state``, ``update``:
    ``[block]``; ``fused``: ``[policy, block]``, the temporaries of a block's F and B as
    one program). ``summed_temp``: per policy, whether a stage's temporaries add up over
    its blocks (recomputation: the backward recomputes them all) rather than the largest."""
    summed = [False] * len(temp) if summed_temp is None else list(summed_temp)
    return Intervals(
        np.stack([_interval_sums(t) for t in time]),
        np.stack([_interval_sums(a) for a in activation]),
        np.stack(
            [
                _interval_sums(x) if add else _interval_max(x)
                for x, add in zip(temp, summed, strict=True)
            ]
        ),
        _interval_sums(state),
        None if update is None else _interval_sums(update),
        None if fused is None else np.stack([_interval_sums(f) for f in fused]),
    )


def compose(
    intervals: Intervals,
    *,
    num_stages: int,
    in_flight: Sequence[int],
    stem: Sequence[np.ndarray] | None,
    head: Sequence[np.ndarray] | None,
    policies: Sequence[str | None],
    launch: float = 0.0,
    update_temp: float = 0.0,
) -> StageTables:
    """`StageTables` for ``num_stages`` stages: the stem's costs added on the first stage,
    the head's on the last, the activations times each stage's ``in_flight`` sets, and
    ``launch`` seconds on every stage (its programs' launches: the per-unit times exclude
    them).

    A stage's peak is ``max(state + in_flight x activations + temp, update)``: ``update``
    (where given; a fifth entry of ``stem`` / ``head``) is what the optimizer update holds,
    state included, plus ``update_temp`` (its scratch); ``temp`` is the forward and backward
    programs' scratch, gone by the update. On the last stage, where the runtime fuses a
    microbatch's F and B, also ``state + fused`` (``Intervals.fused`` and a sixth entry of
    ``head``: the fused programs' temporaries; ``state`` holds three gradients' worth, the
    fused op two).
    """
    size = intervals.state.shape[-1]
    upper = np.triu(np.ones((size, size), dtype=bool))
    nonempty = np.triu(np.ones((size, size), dtype=bool), k=1)
    variants: dict[tuple[bool, bool], tuple[np.ndarray, ...]] = {}
    times = np.empty((num_stages, len(policies), size, size))
    peaks = np.empty_like(times)
    for s in range(num_stages):
        key = (s == 0 and stem is not None, s == num_stages - 1 and head is not None)
        if key not in variants:
            ends = [e for e, here in zip((stem, head), key, strict=True) if here]
            allowed = upper if ends else nonempty
            tt = intervals.time + sum(np.asarray(e[0])[:, None, None] for e in ends) + launch
            aa = intervals.activation + sum(np.asarray(e[1])[:, None, None] for e in ends)
            xx = intervals.temp
            summed = np.array([p is not None for p in policies])[:, None, None]
            for e in ends:  # under recomputation a stage's temporaries add up
                end_temp = np.asarray(e[2])[:, None, None]
                xx = np.where(summed, xx + end_temp, np.maximum(xx, end_temp))
            ss = intervals.state + sum(e[3] for e in ends)
            uu = -INF if intervals.update is None else intervals.update
            uu = uu + sum(e[4] for e in ends if len(e) > 4) + update_temp
            ff = -INF
            if key[1] and intervals.fused is not None:  # the last stage's fused F and B
                ff = intervals.fused + sum(np.asarray(e[5])[:, None, None] for e in ends[-1:])
            uu = np.maximum(uu, ss + ff)
            variants[key] = (np.where(allowed, tt, INF), aa, xx, ss, uu, allowed)
        tt, aa, xx, ss, uu, allowed = variants[key]
        times[s] = tt
        peaks[s] = np.where(allowed, np.maximum(ss + in_flight[s] * aa + xx, uu), INF)
    return StageTables(times, peaks, tuple(policies))


def tables_from_arrays(
    time: np.ndarray,
    activation: np.ndarray,
    state: np.ndarray,
    *,
    num_stages: int,
    temp: np.ndarray | None = None,
    in_flight: Sequence[int] | None = None,
    stem: Sequence[np.ndarray] | None = None,
    head: Sequence[np.ndarray] | None = None,
    policies: Sequence[str | None] = (None,),
) -> StageTables:
    """Builds `StageTables` from per-block arrays.

    Args:
        time, activation, temp: ``[policy, block]``: seconds per microbatch (F + B + W),
            activation bytes per microbatch, temporary bytes.
        state: ``[block]``: training-state bytes per device.
        num_stages: ``S``.
        in_flight: Activation sets alive at once per stage position (default 1 each).
        stem, head: ``(time[policy], activation[policy], temp[policy], state)`` of what the
            first / last stage always holds (``None``: nothing; a stage without blocks is
            then not allowed there).
        policies: The policy of each row of ``time``.
    """
    temp = np.zeros_like(time) if temp is None else temp
    return compose(
        interval_arrays(time, activation, state, temp),
        num_stages=num_stages,
        in_flight=[1] * num_stages if in_flight is None else list(in_flight),
        stem=stem,
        head=head,
        policies=policies,
    )
