"""Running gradient sums kept per device over the rows of a microbatch: one all-reduce a step.

On a place of several devices whose microbatch is split over a mesh axis (data parallel,
alone or with a tensor-parallel axis), the SPMD partitioner ends every weight gradient's
reduction over the batch with an all-reduce over that axis: each backward unit all-reduces
its block's gradients, once per microbatch, one operand per parameter. XLA's CPU runtime
prices a tuple all-reduce per operand (35 operands over 4 devices: 1.6-2.2 ms; the same
bytes as one array: 0.2-0.3 ms), and the SPMD pipeline a user writes by hand pays it less
often, because XLA sums its microbatches' gradients locally inside its one program before
reducing them.

``_stacked_units.stack_chain`` does that across our units. Each reduction over the batch that a
block's gradient comes from (a ``dot_general`` contracting, or a ``reduce_sum`` reducing,
the leading dimension of its operands) is evaluated per device: its operands' leading
dimension split into ``(d, n / d)``, ``d`` the size of the mesh axes the batch is sharded
over, and the reduction mapped over the ``d`` slices (``jax.vmap`` with that
``spmd_axis_name``), so each device reduces its own rows and nothing is communicated. The
linear equations between those reductions and the block's gradient outputs (transposes,
reshapes, sums of such partial values, scaling by other values...) are mapped over the
slices too. The block then returns each gradient as ``d`` partial sums, stacked on a leading
dimension sharded over the batch's axes. Where the batch spans every device of the place
(data parallel), the chain's running sum is one such stack of the whole chain, flattened
(``flat_k = flat_{k-1} + concat(g_k reshaped (d, -1))``), and the glue that reads the final
sums adds the ``d`` rows (one all-reduce of one array a step) before slicing them out.
Where it spans only some (``data`` 2 x ``model`` 2: tensor parallel too), flattening would
gather the gradients split over the other axes; each gradient then keeps a stack of its
own, laid out as the gradient with the batch's axes in front (``P("data", *spec)``), and the
glue adds each one's rows (``_packed_sums._own_sums``).

A gradient may pass through several blocks of its unit: the Flax step's backward computes it
in one block and lays it out as its parameter in the next (a block of sharding
constraints). Each block then takes the stacks its predecessor made (an input only it
reads, which the predecessor can make stacked: an activation it reads cannot be) and maps
its linear equations over them (``_stacked_units``).

Values: the same sums over microbatches and devices in another order: per device over
microbatches, then over devices, where before it was over devices, then microbatches. Not
bit for bit the unstacked step's results: equal up to float rounding, like any other
reassociation of a sum (the tests compare with the unparallelized step at tolerances).

A ``scatter-add`` of the batch's rows into zeros (an embedding table's gradient, the
transpose of its lookup) is such a reduction too: each device scatters its own rows'
updates into a table of zeros of its own (its indices and updates split, the zeros not).

What is stacked: a chain qualifying for ``_packed_sums`` (sums of one dtype, one is enough,
each running sum read by the next link alone, the finals read first by glue on the place),
on a place of two or more devices whose fragments shard the leading dimension of the arrays
the reductions read over one set of mesh axes (read from their sharding constraints:
:func:`batch_axes`), where every gradient the chain adds is an output of a block of the
unit that nothing else reads and that the analysis below traces back to such reductions
through linear equations only, within its block or through blocks before it. Where those
axes span only some of the place's devices, the unit must also lay every gradient out
(a sharding constraint: ``parallelize_step`` does on tensor-parallel stages), on axes other
than the batch's. Anything else (a scatter into anything but zeros, gradients of a
parameter used in two blocks, unconstrained gradients on a tensor-parallel stage (``mm.jit``
of a plain function), gradients split over the batch's axes (ZeRO), Explicit mesh axes, a
trace that fails) leaves the chain as it is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import numpy as np
from jax._src import source_info_util
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from multimesh_flax.core.trace import (
    BoundedCache,
    block_body,
    concrete_constraint,
    equation_readers,
    is_block,
)

# Equations linear in their first operand (the only array operand that may be stacked).
_UNARY = frozenset(
    {
        "transpose",
        "reshape",
        "convert_element_type",
        "neg",
        "reduce_sum",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "slice",
        "rev",
        "sharding_constraint",
    }
)
_SUMS = frozenset({"add_any", "add", "sub"})  # linear when every operand is stacked


class Batch(NamedTuple):
    """The mesh axes a place's microbatch rows are sharded over, and their total size."""

    mesh: Any  # the concrete mesh of the place's sharding constraints
    axes: tuple[str, ...]
    size: int

    def sharding(self) -> NamedSharding:
        """Leading dimension over the batch's axes, the rest replicated (a flat running
        sum's: the batch spans every device of the place)."""
        return NamedSharding(self.mesh, PartitionSpec(self.axes))

    def rows(self, ndim: int) -> NamedSharding:
        """Leading dimension over the batch's axes, the other ``ndim - 1`` left to the
        compiler (a tensor-parallel stage's gradient stays split over its other axes)."""
        rest = (PartitionSpec.UNCONSTRAINED,) * (ndim - 1)
        return NamedSharding(self.mesh, PartitionSpec(self.axes, *rest))

    def stacked(self, spec: PartitionSpec) -> NamedSharding:
        """A stack of partial sums of an array laid out as ``spec``: its rows over the
        batch's axes, the array's dimensions as ``spec`` says."""
        return NamedSharding(self.mesh, PartitionSpec(self.axes, *spec))


def batch_axes(eqns: Sequence[Any]) -> dict[int, Batch]:
    """Per leading size, the axes sharding the leading dimension of the constrained arrays
    of that size in ``eqns`` (rank >= 2, looking into blocks; a place's fragments: a
    backward may constrain nothing its forward did not), where the arrays that shard it
    agree (a gpt-tiny microbatch of 4 sequences shares its leading size with the attention
    output's kernel of 4 heads, sharded over a ``model`` axis of one device); one mesh, Auto
    axes only (else ``{}``)."""
    found: dict[int, set[tuple[str, ...]]] = {}
    meshes = set()
    for eqn in _all_eqns(eqns, set()):
        if eqn.primitive.name != "sharding_constraint" or eqn.invars[0].aval.ndim < 2:
            continue
        sharding = concrete_constraint(eqn)
        if sharding is None:  # not on a mesh of devices: which devices it shards is unknown
            return {}
        meshes.add(sharding.mesh)
        entry = (tuple(sharding.spec) or (None,))[0]
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        found.setdefault(eqn.invars[0].aval.shape[0], set()).add(axes)
    if len(meshes) != 1:
        return {}
    (mesh,) = meshes
    if any(t != AxisType.Auto for t in mesh.axis_types):
        return {}
    result = {}
    for size, named in found.items():
        # Axes of size 1 shard nothing: a tensor-parallel axis of one device, say.
        entries = {tuple(a for a in axes if mesh.shape[a] > 1) for axes in named}
        entries.discard(())  # a weight of that leading size, say, replicated along it
        if len(entries) == 1 and (axes := next(iter(entries))):
            d = math.prod(mesh.shape[a] for a in axes)
            if d >= 2 and size % d == 0:
                result[size] = Batch(mesh, axes, d)
    return result


def _all_eqns(eqns: Sequence[Any], seen: set[int]) -> Iterator[Any]:
    """``eqns`` and those of their blocks' bodies, each body once (every microbatch's copy
    of a block shares its body: ``seen`` holds the ids of the bodies already walked)."""
    for eqn in eqns:
        yield eqn
        if is_block(eqn) and id(body := block_body(eqn)) not in seen:
            seen.add(id(body))
            yield from _all_eqns(body.eqns, seen)


class _Plan:
    """Which equations of a block body compute its requested outputs per device: the
    reductions to split (``split``) and the linear equations to map over the stacked values,
    with the positions of their stacked operands (``linear``)."""

    def __init__(self, jaxpr: Any, batches: dict[int, Batch], open_inputs: frozenset) -> None:
        self.jaxpr = jaxpr
        self.batches = batches
        self.made = {v: e for e in jaxpr.eqns for v in e.outvars}
        self.open = open_inputs  # inputs that may come in stacked (another block's output)
        self.inputs: set[Any] = set()  # those that must
        self.split: dict[int, Batch] = {}
        self.linear: dict[int, tuple[int, ...]] = {}
        self.stacked: set[Any] = set()
        self._can: dict[Any, bool] = {}

    def input_positions(self) -> tuple[int, ...]:
        """The positions of the inputs the body takes stacked."""
        return tuple(i for i, v in enumerate(self.jaxpr.invars) if v in self.inputs)

    def can(self, v: Any) -> bool:
        """Whether ``v`` can be computed as per-device partial sums."""
        if isinstance(v, jex.Literal):
            return False
        if v in self.open:
            return True
        if v not in self.made:
            return False
        if v not in self._can:
            self._can[v] = False  # no cycles in a jaxpr; guards the recursion all the same
            self._can[v] = self._stacked_form(self.made[v]) is not None
        return self._can[v]

    def _stacked_form(self, eqn: Any) -> tuple[int, ...] | Batch | None:
        """The positions of ``eqn``'s operands to stack (linear), the batch to split it over
        (a reduction over the batch), or ``None``."""
        name, ops = eqn.primitive.name, eqn.invars
        if len(eqn.outvars) != 1 or eqn.effects:
            return None
        if name in _UNARY and self.can(ops[0]):
            return (0,)
        if name in _SUMS:
            return tuple(range(len(ops))) if all(self.can(x) for x in ops) else None
        if name in ("mul", "dot_general"):
            for i, x in enumerate(ops):
                if self.can(x):
                    return (i,)
        if name == "div" and self.can(ops[0]):
            return (0,)
        return self._reduction(eqn)

    def _reduction(self, eqn: Any) -> Batch | None:
        """The batch a reduction over its operands' leading dimension splits over."""
        name, ops = eqn.primitive.name, eqn.invars
        if name == "reduce_sum" and 0 in eqn.params["axes"]:
            return self.batches.get(ops[0].aval.shape[0])
        if name == "scatter-add":
            return self._scatter_into_zeros(eqn)
        if name != "dot_general":
            return None
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if 0 not in lc or 0 not in rc or lc.index(0) != rc.index(0) or 0 in lb or 0 in rb:
            return None
        size = ops[0].aval.shape[0]
        return self.batches.get(size) if ops[1].aval.shape[0] == size else None

    def _scatter_into_zeros(self, eqn: Any) -> Batch | None:
        """The batch a ``scatter-add`` of rows into zeros splits over: an embedding table's
        gradient (the transpose of its lookup), each device adding its own rows' updates
        into a table of its own. The leading dimension of the indices and of the updates
        must be the rows (a scatter dimension, not a window's), the operand zeros (added
        once per device, it must add nothing)."""
        operand, indices, updates = eqn.invars
        numbers = eqn.params["dimension_numbers"]
        if numbers.operand_batching_dims or 0 in numbers.update_window_dims:
            return None
        if indices.aval.ndim < 2 or not self._zeros(operand):
            return None
        size = updates.aval.shape[0]
        return self.batches.get(size) if indices.aval.shape[0] == size else None

    def _zeros(self, v: Any) -> bool:
        """Whether ``v`` is a broadcast literal zero (converted or not)."""
        eqn = None if isinstance(v, jex.Literal) else self.made.get(v)
        while eqn is not None and eqn.primitive.name == "convert_element_type":
            (v,) = eqn.invars
            eqn = None if isinstance(v, jex.Literal) else self.made.get(v)
        if eqn is None or eqn.primitive.name != "broadcast_in_dim":
            return False
        (value,) = eqn.invars
        return isinstance(value, jex.Literal) and not np.any(value.val)

    def mark(self, v: Any) -> None:
        """Plans ``v`` (``can(v)`` must hold) and what it comes from per device."""
        if v in self.stacked:
            return
        self.stacked.add(v)
        if v in self.open:
            self.inputs.add(v)
            return
        eqn = self.made[v]
        form = self._stacked_form(eqn)
        if isinstance(form, Batch):
            self.split[id(eqn)] = form
            return
        self.linear[id(eqn)] = form
        for i in form:
            self.mark(eqn.invars[i])


def _split_operands(eqn: Any) -> tuple[int, ...]:
    """The operands of a split reduction whose leading dimension is the batch's rows: a
    scatter's indices and updates (its operand, zeros, is each device's own), else all."""
    return (1, 2) if eqn.primitive.name == "scatter-add" else tuple(range(len(eqn.invars)))


def plan_body(
    body: Any, outs: tuple[int, ...], open_ins: tuple[int, ...], batches: dict[int, Batch]
) -> _Plan | None:
    """How ``body`` (a block's closed jaxpr) computes its outputs at ``outs`` as per-device
    partial sums, taking those of its inputs at ``open_ins`` it needs as such stacks
    (``plan.input_positions()``); ``None`` where an output cannot be (module doc), its
    reductions split over several batches, or a stacked input is also needed whole.
    Cached per body."""
    key = (id(body), outs, open_ins, tuple(sorted(batches.items())))
    made = _PLANS.get_or_make(key, lambda _: (body, _plan_body(body, outs, open_ins, batches)))
    return made[1]


def _plan_body(
    body: Any, outs: tuple[int, ...], open_ins: tuple[int, ...], batches: dict[int, Batch]
) -> _Plan | None:
    jaxpr = body.jaxpr
    plan = _Plan(jaxpr, batches, frozenset(jaxpr.invars[i] for i in open_ins))
    wanted = [jaxpr.outvars[i] for i in outs]
    if not all(plan.can(v) for v in wanted):
        return None
    for v in wanted:
        plan.mark(v)
    if len(set(plan.split.values())) > 1 or plan.inputs & _needed(jaxpr, plan, set(outs)):
        return None
    return plan


def stacked_body(body: Any, outs: tuple[int, ...], plan: _Plan, batch: Batch) -> Any | None:
    """``body`` (a block's closed jaxpr) as ``plan`` (:func:`plan_body` of its outputs at
    ``outs``) says: those outputs, and its inputs at ``plan.input_positions()``, stacks of
    per-device partial sums on a leading dimension of the batch's size; ``None`` where the
    rewrite fails to trace. Cached per plan (itself cached per body and outputs)."""
    key = (id(plan), batch)
    made = _BODIES.get_or_make(key, lambda _: (plan, _stacked_body(body, outs, plan, batch)))
    return made[1]


# (body id, ...) -> (the body, kept alive while its id is a key; its plan), and
# (plan id, batch) -> (the plan, likewise; the body's rewrite)
_PLANS = BoundedCache(capacity=256)
_BODIES = BoundedCache(capacity=256)


def _stacked_body(body: Any, outs: tuple[int, ...], plan: _Plan, batch: Batch) -> Any | None:
    jaxpr = body.jaxpr
    run = functools.partial(_evaluate, jaxpr, list(body.consts), plan, batch, set(outs))
    avals = [
        jax.ShapeDtypeStruct((batch.size, *v.aval.shape) if v in plan.inputs else v.aval.shape,
                             v.aval.dtype)
        for v in jaxpr.invars
    ]  # fmt: skip
    try:
        return jax.make_jaxpr(run)(*avals)
    except Exception:  # noqa: BLE001 -- a body the rewrite cannot trace stays as it is
        return None


def _needed(jaxpr: Any, plan: _Plan, positions: set[int]) -> set[Any]:
    """The variables the rewritten body still computes unstacked."""
    need = {v for i, v in enumerate(jaxpr.outvars) if i not in positions}
    for eqn in reversed(jaxpr.eqns):
        key = id(eqn)
        if eqn.effects or any(v in need for v in eqn.outvars) or key in plan.split:
            used = eqn.invars
        else:
            used = [v for i, v in enumerate(eqn.invars) if i not in plan.linear.get(key, ())]
            used = used if key in plan.linear else []
        need.update(v for v in used if not isinstance(v, jex.Literal))
    return need


def _evaluate(
    jaxpr: Any, consts: list[Any], plan: _Plan, batch: Batch, positions: set[int], *args: Any
) -> list[Any]:
    """The body over ``args``, with the planned equations evaluated per device."""
    need = _needed(jaxpr, plan, positions)
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    stacked: dict[Any, Any] = {}
    for v, x in zip(jaxpr.invars, args, strict=True):
        (stacked if v in plan.inputs else env)[v] = x

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    folded = _folded_transposes(jaxpr, plan)
    done = {id(t) for t in folded.values()}
    for eqn in jaxpr.eqns:
        key = id(eqn)
        if eqn.effects or any(v in need for v in eqn.outvars):
            outs = _bind(eqn, [read(v) for v in eqn.invars])
            outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs, strict=True))
        if key in plan.split:
            where = _split_operands(eqn)
            values = [_split(read(v), batch) if i in where else read(v)
                      for i, v in enumerate(eqn.invars)]  # fmt: skip
            axes = [0 if i in where else None for i in range(len(values))]
            if key in folded:  # the transpose reading it, folded in: operands swapped
                made = _mapped(_swapped(eqn), values[::-1], axes[::-1], batch)
                stacked[folded[key].outvars[0]] = made
            else:
                stacked[eqn.outvars[0]] = _mapped(eqn, values, axes, batch)
        elif key in plan.linear and key not in done:
            where = plan.linear[key]
            values = [stacked[v] if i in where else read(v) for i, v in enumerate(eqn.invars)]
            axes = [0 if i in where else None for i in range(len(values))]
            stacked[eqn.outvars[0]] = _mapped(eqn, values, axes, batch)
    return [
        jax.lax.with_sharding_constraint(stacked[v], batch.rows(stacked[v].ndim))
        if i in positions
        else read(v)
        for i, v in enumerate(jaxpr.outvars)
    ]


def _folded_transposes(jaxpr: Any, plan: _Plan) -> dict[int, Any]:
    """Per split ``dot_general`` (by id) whose one reader is a planned ``transpose`` putting
    its rhs's free dimensions before its lhs's, that transpose: the dot with its operands
    swapped computes the transposed result directly.

    Autodiff writes a weight's gradient so (``transpose(dot_general(g, x))``), and XLA
    folds the transpose into the dot, but not once the dot is mapped over the devices'
    rows: each unit then copied every weight gradient through a transpose (on this CPU
    host ~3-8% of a residual-MLP step, design notes "Own running sums")."""
    readers = equation_readers(jaxpr.eqns, jaxpr.outvars)
    folded = {}
    for eqn in jaxpr.eqns:
        if id(eqn) not in plan.split or eqn.primitive.name != "dot_general":
            continue
        (lc, _), (lb, rb) = eqn.params["dimension_numbers"]
        out = eqn.outvars[0]
        lhs_free = eqn.invars[0].aval.ndim - len(lc)
        swap = (*range(lhs_free, out.aval.ndim), *range(lhs_free))
        match readers.get(out, []):
            case [int(i)] if not (lb or rb):
                t = jaxpr.eqns[i]
                transposes = t.primitive.name == "transpose" and id(t) in plan.linear
                if transposes and tuple(t.params["permutation"]) == swap:
                    folded[id(eqn)] = t
    return folded


def _swapped(eqn: Any) -> Any:
    """A batch-free ``dot_general`` with its operands swapped: its result transposed, the
    rhs's free dimensions first (and so in its ``out_sharding``)."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    precision, sharding = eqn.params.get("precision"), eqn.params.get("out_sharding")
    params = {**eqn.params, "dimension_numbers": ((rc, lc), ((), ()))}
    if isinstance(precision, tuple):
        params["precision"] = precision[::-1]
    if sharding is not None:
        lhs_free, ndim = eqn.invars[0].aval.ndim - len(lc), eqn.outvars[0].aval.ndim
        spec = (*sharding.spec, *(None,) * (ndim - len(sharding.spec)))
        swapped = PartitionSpec(*spec[lhs_free:], *spec[:lhs_free])
        params["out_sharding"] = sharding.update(spec=swapped)
    return eqn.replace(invars=eqn.invars[::-1], params=params)


def _bind(eqn: Any, values: list[Any]) -> Any:
    """``eqn`` applied to ``values``, traced under its own source information (where it was
    written, its name stack: what a non-finite value's report names) as ``eval_jaxpr``
    does; JAX has no public accessor for it."""
    info = eqn.source_info
    stack = source_info_util.current_name_stack() + info.name_stack
    where = source_info_util.user_context(info.traceback, name_stack=stack)
    with where, eqn.ctx.manager:
        return eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))


def _split(x: Any, batch: Batch) -> Any:
    """``x`` with its leading dimension ``n`` as ``(d, n / d)``, the ``d`` over the batch's
    axes: each device's own rows."""
    rows = x.reshape(batch.size, x.shape[0] // batch.size, *x.shape[1:])
    return jax.lax.with_sharding_constraint(rows, batch.rows(rows.ndim))


def _mapped(eqn: Any, values: list[Any], axes: list[Any], batch: Batch) -> Any:
    """``eqn`` mapped over the leading dimension of the operands at ``axes`` 0."""
    return jax.vmap(lambda *v: _bind(eqn, list(v)), in_axes=axes, spmd_axis_name=batch.axes)(
        *values
    )
