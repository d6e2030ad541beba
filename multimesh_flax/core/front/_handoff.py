"""Handing values between a task's submesh and the rest of a model that runs outside
every jit of ours: eagerly, under eager ``jax.grad``/``jax.vmap``, and under an eager
``jax.checkpoint``.

A task computes on its submesh, where its variables are committed; what it hands back
meets arrays the model holds elsewhere (a variable no task owns may sit on any submesh, a
tied embedding where its first use is). Eagerly, JAX refuses to mix committed arrays of
different devices in one operation, but moves *uncommitted* ones -- what ``jnp``
functions return -- to wherever they are needed. So a task called outside every jit of
ours hands its results back *released* (:func:`release`: uncommitted, where they are),
and the cotangents of its arguments likewise, and they add up with arrays from anywhere.

Under an eager ``jax.checkpoint`` the task is traced: JAX stages the checkpointed
function first, then evaluates the staged program equation by equation (``remat_p``'s
implementation is ``core.eval_jaxpr``; its JVP, partial evaluation and transpose bind
``remat_p`` again and end in the same evaluation). A traced ``jax.device_put`` must be
told where its operand comes from, for its transpose, which is unknown while tracing, and
it cannot release. :func:`handoff` is one primitive that moves its operand to ``dst``
and whose transpose moves the cotangent to ``src``; either end is a sharding (the task's
submesh) or :data:`RELEASED`. It does what it says eagerly, under eager ``jax.grad`` and
``jax.vmap``, and inside the checkpoint's op-by-op evaluation; inside a compiled program
(``jax.jit`` of the transformation) it is the identity: XLA places values there.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

#: The end of a move that is no sharding: the array uncommitted where it is (:func:`release`).
RELEASED = None

handoff_p = Primitive("mm_handoff")


def handoff(
    x: jax.Array, dst: jax.sharding.Sharding | None, src: jax.sharding.Sharding | None
) -> jax.Array:
    """``x`` moved to ``dst`` (a sharding, or :data:`RELEASED`), differentiably: under
    ``jax.grad`` its cotangent moves to ``src`` (likewise).

    Example:
        >>> x = jax.device_put(jax.numpy.ones(2), jax.devices()[0])
        >>> handoff(x, RELEASED, RELEASED).committed
        False
    """
    return handoff_p.bind(x, dst=dst, src=src)


def release(x: jax.Array) -> jax.Array:
    """``x`` uncommitted, where it is (on its first device; values unchanged), as the
    arrays ``jnp`` functions return eagerly: JAX moves it to wherever the next operation
    needs it. Arrays that cannot be uncommitted (extended dtypes such as PRNG keys, arrays
    spanning processes) stay as they are."""
    if not x.committed or not x.is_fully_addressable:
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return x
    device = x.addressable_shards[0].device
    single = x.addressable_shards[0].data if x.sharding.is_fully_replicated else None
    if single is None or single.aval.sharding.mesh.axis_types:  # typed: retype it
        single = jax.device_put(x, jax.sharding.SingleDeviceSharding(device))
    # No public way to drop an array's commitment (jax 0.10): the same buffer, uncommitted,
    # typed as an unsharded array (a result of Explicit axes keeps no mesh in its type).
    from jax._src import array, core

    aval = core.ShapedArray(x.shape, x.dtype, weak_type=x.aval.weak_type)
    return array.ArrayImpl(aval, single.sharding, [single], committed=False)


def _impl(x: jax.Array, *, dst: Any, src: Any) -> jax.Array:
    del src
    if dst is RELEASED:
        return release(x)
    if x.committed and x.sharding.is_equivalent_to(dst, x.ndim):
        return x
    return jax.device_put(x, dst)


def _transpose(ct: Any, x: Any, *, dst: Any, src: Any) -> list[Any]:
    del x
    return [handoff_p.bind(ct, dst=src, src=dst)]


def _batch(args: Any, dims: Any, **params: Any) -> tuple[jax.Array, Any]:
    return handoff_p.bind(args[0], **params), dims[0]


handoff_p.def_impl(_impl)
handoff_p.def_abstract_eval(lambda x, **_: x)
ad.deflinear2(handoff_p, _transpose)  # Zero cotangents are handled by deflinear2
batching.primitive_batchers[handoff_p] = _batch
mlir.register_lowering(handoff_p, lambda ctx, x, **_: [x])
