"""Where a pipelined step's wall time goes: host dispatch, device compute per submesh,
transfers, and what is left (waiting).

* **Runtime overhead** is the CPU time of the dispatching thread during a step
  (``time.thread_time``) outside JAX's calls of the step's programs and transfers
  (:class:`JaxClock`): argument checks, the op loop, slots and frees -- what our runtime
  adds to calling the same programs by hand. CPU time, not wall time: it does not grow when
  another process holds the core, so it reproduces from run to run (the median of ``rounds``
  steps). Inside the calls the thread's time is JAX's dispatch and, for programs XLA on CPU
  deems cheap, the program itself, which then runs before the call returns; that is
  reported as "inside JAX calls".
* **Compute per submesh** and **transfers** come from one step recorded with
  ``mm.record_timeline()``, which waits for each op before the next: an op's duration is its
  own work, with no other op overlapping it (plus its dispatch and the wait, so these are
  upper bounds).
* **Beyond the busiest submesh**: the step's wall time minus the compute of the submesh with
  the most. A perfectly overlapped pipeline would get it down to the transfers on the
  critical path; the rest is bubble, host time on the critical path and waiting.

Example:
    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda x: x @ x)
    >>> x = jnp.ones((64, 64))
    >>> cpu = host_cpu_seconds(lambda: f(x).block_until_ready(), rounds=3)
    >>> 0 < cpu < 1
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.lib import xla_client as _xc  # the C++ copy StubbedCpp stubs
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from benchmarks import _common


class JaxClock:
    """Adds up this thread's CPU time inside an executable's fragment calls and transfers
    (each op's ``state.fns`` entry) and ``jax.device_put`` while active (``with clock:``); a
    ``device_put`` inside a timed op counts once."""

    def __init__(self, exe: Any) -> None:
        self.exe = exe
        self.inside = 0.0
        self._saved: list[tuple[int, Any]] = []
        self._depth = 0

    def _timed(self, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside += time.thread_time() - start
                self._depth -= 1

        return wrapped

    def __enter__(self) -> JaxClock:
        self.inside = 0.0
        fns = self.exe.state.fns  # what each op calls (see core/run/_ops.py)
        self._saved = list(enumerate(fns))
        for i, fn in self._saved:
            fns[i] = self._timed(fn)
        self._device_put = jax.device_put
        jax.device_put = self._timed(self._device_put)
        return self

    def __exit__(self, *_: Any) -> None:
        jax.device_put = self._device_put
        for i, fn in self._saved:
            self.exe.state.fns[i] = fn


class _Stubs:
    """A step's JAX work replaced by what it returned in one recorded step (``record``):
    inside ``with stubs:``, the ops in ``stubbed_ops`` (indices into ``exe.state.fns``)
    return their recorded outputs, and the function ``owner.<name>`` returns its recorded
    results in order (only its calls outside the stubbed ops when ``outside_ops_only``)."""

    owner: Any
    name: str
    outside_ops_only: bool

    def __init__(self, exe: Any, stubbed_ops: list[int]) -> None:
        self.exe = exe
        self.stubbed_ops = stubbed_ops
        self.runs: dict[int, Any] = {}  # op index -> its recorded outputs
        self.results: list[Any] = []  # owner.<name>'s results, in call order
        self._next = 0
        self._saved: dict[int, Any] = {}
        self._real: Any = None

    def record(self, call: Callable[[], Any]) -> Any:
        """Runs ``call`` (one real step of the executable) and keeps what it computed."""
        fns = self.exe.state.fns
        real = {i: fns[i] for i in self.stubbed_ops}
        inside = [0]  # stubbed ops running

        def keeping(i: int, fn: Any) -> Any:
            def kept(*args: Any) -> Any:
                inside[0] += 1
                try:
                    self.runs[i] = fn(*args)
                finally:
                    inside[0] -= 1
                return self.runs[i]

            return kept

        function = getattr(self.owner, self.name)

        def kept_call(*args: Any, **kwargs: Any) -> Any:
            result = function(*args, **kwargs)
            if not (self.outside_ops_only and inside[0]):
                self.results.append(result)
            return result

        for i, fn in real.items():
            fns[i] = keeping(i, fn)
        setattr(self.owner, self.name, kept_call)
        try:
            return call()
        finally:
            setattr(self.owner, self.name, function)
            for i, fn in real.items():
                fns[i] = fn

    def _replay(self, *_: Any, **__: Any) -> Any:
        out = self.results[self._next % len(self.results)]
        self._next += 1
        return out

    def __enter__(self) -> _Stubs:
        fns = self.exe.state.fns
        self._saved = {i: fns[i] for i in self.runs}
        for i, outs in self.runs.items():
            fns[i] = lambda *_, outs=outs: outs
        self._real, self._next = getattr(self.owner, self.name), 0
        if self.results:
            setattr(self.owner, self.name, self._replay)
        return self

    def __exit__(self, *_: Any) -> None:
        setattr(self.owner, self.name, self._real)
        for i, fn in self._saved.items():
            self.exe.state.fns[i] = fn


class StubbedJax(_Stubs):
    """JAX's calls of a step stubbed out: inside ``with stubs:``, every fragment call and
    transfer of the executable returns what it returned in one recorded step (``record``),
    and ``jax.device_put`` (placing inputs) returns the recorded results in order.

    What is left of a step is the host's own work -- the runtime's argument checks, slots and
    op loop, or a hand replay's -- with no XLA work on the host's cores and no buffers
    freed, so it can be repeated hundreds of times back to back and timed in CPU time to a
    few percent, where the same difference inside real steps (milliseconds of XLA work
    between the host's microseconds) swung by 2x between runs. The state is not donated
    while stubbed: the same state can be passed every call.
    """

    owner, name, outside_ops_only = jax, "device_put", True

    def __init__(self, exe: Any) -> None:
        super().__init__(exe, list(range(len(exe.state.fns))))


# The host's speed comes in stretches: on this shared host the same calls take 1.6-1.8x longer
# for seconds to tens of seconds at a time, in any process (a busy loop on the other core does
# not cause it; the machine under this one does). Host work is therefore measured in short
# blocks sampled over a span of wall time long enough to hold fast stretches, and each
# measured thing gets its fastest block: load only ever adds.
BLOCK_CALLS = 5 if _common.SMOKE else 40  # calls per block
SPAN_SECONDS = 0.2 if _common.SMOKE else 20.0  # wall time the blocks are spread over


def fastest_block_means(
    fns: dict[str, Callable[[], Any]],
    calls: int = BLOCK_CALLS,
    span: float = SPAN_SECONDS,
    min_blocks: int = 3,
) -> dict[str, float]:
    """This thread's CPU seconds per call of each of ``fns``: the least, over blocks of
    ``calls`` calls, of a block's mean. The functions alternate block by block until
    ``span`` seconds of wall time have passed (at least ``min_blocks`` blocks each).

    Example:
        >>> means = fastest_block_means({"noop": lambda: None}, calls=10, span=0.01)
        >>> 0 <= means["noop"] < 1e-3
        True
    """
    least = dict.fromkeys(fns, float("inf"))
    start, blocks = time.perf_counter(), 0
    while blocks < min_blocks or time.perf_counter() - start < span:
        for name, fn in fns.items():
            cpu = time.thread_time()
            for _ in range(calls):
                fn()
            least[name] = min(least[name], (time.thread_time() - cpu) / calls)
        blocks += 1
    return least


def stubbed_host_seconds(
    runner: _common.MpmdRunner, span: float = SPAN_SECONDS
) -> dict[str, float]:
    """This thread's CPU seconds per step with JAX's calls stubbed (:class:`StubbedJax`):
    ``"call"`` for the step function, ``"replay"`` for the hand replay of the same ops
    (``_common.replay`` with the state flattened and the outputs unflattened, as a program
    juggling these arrays must), each its fastest block over ``span`` seconds
    (:func:`fastest_block_means`). Runs one real step first (the runner's state advances by
    it)."""
    exe = runner.executable
    stubs = StubbedJax(exe)
    loss, state = stubs.record(lambda: runner.step_fn(runner.state, runner.batch))
    jax.block_until_ready((loss, state))
    runner.state, batch = state, runner.batch
    tree = jax.tree_util.tree_structure(state)
    batch_leaves = jax.tree_util.tree_leaves(batch)

    def replay() -> Any:
        leaves = [*jax.tree_util.tree_leaves(state), *batch_leaves]
        return jax.tree_util.tree_unflatten(tree, _common.replay(exe, leaves)[1:])

    step_fn = runner.step_fn
    with stubs:
        return fastest_block_means(
            {"call": lambda: step_fn(state, batch), "replay": replay}, span=span
        )


class StubbedCpp(_Stubs):
    """Only JAX's C++ work of a step stubbed: inside ``with stubs:``, every fragment's
    executable returns what it returned in one recorded step (``record``), and the C++ copy
    a transfer ends in (``xla_client.batched_copy_array_to_devices_with_sharding``, reached
    through ``jax.device_put`` or the runtime's ``Move``) returns the recorded copies in
    order. Everything in Python runs: the runtime's op loop, and JAX's own Python around
    the copies -- the host cost per op that decides whether a host keeps ahead of its
    devices. As with :class:`StubbedJax`, the state is not donated while stubbed."""

    owner, name, outside_ops_only = _xc, "batched_copy_array_to_devices_with_sharding", False

    def __init__(self, exe: Any) -> None:
        super().__init__(exe, [i for i, op in enumerate(exe.ops) if op.kind == 0])


def python_host_seconds(runner: _common.MpmdRunner, span: float = SPAN_SECONDS) -> float:
    """This thread's CPU seconds per step with only JAX's C++ work stubbed
    (:class:`StubbedCpp`): the fastest block over ``span`` seconds
    (:func:`fastest_block_means`). Runs one real step first (the runner's state advances
    by it)."""
    stubs = StubbedCpp(runner.executable)
    loss, state = stubs.record(lambda: runner.step_fn(runner.state, runner.batch))
    jax.block_until_ready((loss, state))
    runner.state, batch, step_fn = state, runner.batch, runner.step_fn
    with stubs:
        return fastest_block_means({"step": lambda: step_fn(state, batch)}, span=span)["step"]


def host_cpu_seconds(step: Callable[[], Any], rounds: int) -> float:
    """The median CPU time of this thread across ``rounds`` calls of ``step``."""
    samples = []
    for _ in range(rounds):
        start = time.thread_time()
        step()
        samples.append(time.thread_time() - start)
    return _common.median(samples)


def recorded_seconds(runner: _common.MpmdRunner) -> dict[str, Any]:
    """Compute seconds per submesh and transfer seconds of one recorded step."""
    import multimesh_flax as mm

    with mm.record_timeline() as timeline:
        runner.step()
    compute: dict[str, float] = {}
    transfers = 0.0
    for event in timeline.events:
        if event.kind == "transfer":
            transfers += event.end - event.start
        else:
            place = ",".join(map(str, event.place))
            compute[place] = compute.get(place, 0.0) + event.end - event.start
    return {"compute_per_submesh_s": compute, "transfers_s": transfers}


def runtime_cpu_seconds(runner: _common.MpmdRunner, rounds: int) -> tuple[float, float]:
    """Medians over ``rounds`` steps of this thread's CPU time outside and inside JAX's calls
    of the step's programs and transfers."""
    outside, inside = [], []
    with JaxClock(runner.executable) as clock:
        for _ in range(rounds):
            clock.inside, start = 0.0, time.thread_time()
            runner.step()
            outside.append(time.thread_time() - start - clock.inside)
            inside.append(clock.inside)
    return _common.median(outside), _common.median(inside)


def step_breakdown(runner: _common.MpmdRunner, step_s: float, rounds: int) -> dict[str, Any]:
    """The account of one pipelined step whose median wall time is ``step_s``."""
    ops = len(runner.executable.ops)
    python = python_host_seconds(runner)
    runtime, inside = runtime_cpu_seconds(runner, rounds)
    recorded = recorded_seconds(runner)
    busiest = max(recorded["compute_per_submesh_s"].values())
    return {
        "step_s": step_s,
        "ops": ops,
        "runtime_cpu_s": runtime,
        "runtime_per_op_us": 1e6 * runtime / ops,
        "python_host_cpu_s": python,
        "python_host_per_op_us": 1e6 * python / ops,
        "inside_jax_calls_cpu_s": inside,
        **recorded,
        "busiest_compute_s": busiest,
        "beyond_busiest_s": step_s - busiest,
        # XLA's CPU client runs programs of several devices one at a time (B0): there a step
        # of such stages lasts about all submeshes' compute, not the busiest one's.
        "all_compute_s": sum(recorded["compute_per_submesh_s"].values()),
    }


def peer_breakdown(peer: Any, step_s: float, rounds: int) -> dict[str, Any]:
    """The SPMD peer's step as far as it splits: one program, so the thread's CPU time in its
    call (dispatch, and the program if XLA runs it inline) and the rest of the step (its
    compute on XLA's threads, collectives and waiting)."""
    cpu = host_cpu_seconds(peer.step, rounds)
    return {"step_s": step_s, "ops": 1, "call_cpu_s": cpu, "rest_s": step_s - cpu}


ARITIES = ((1, 1), (1, 34), (17, 1), (40, 17), (100, 100), (300, 300))
CHAINS = (1, 10, 30, 100)


def jax_call_costs(
    rounds: int = 100,
    devices: Sequence[Any] | None = None,
    arities: Sequence[tuple[int, int]] = ARITIES,
    chains: Sequence[int] = CHAINS,
) -> dict[str, float]:
    """Microseconds until a compiled program's call returns, before its results are ready
    (medians of ``rounds`` calls): by the arrays it takes and returns (``"in 17 out 1"``:
    64 x 64 float32 arrays replicated over ``devices``, default the first device, their sum
    scaled once per output) and by the kernels it launches (``"chain 30"``: 30 matmuls of
    256 x 256, each followed by ``tanh``). What JAX's own call costs the host per op, whoever
    makes it: the floor under any runtime's dispatch. (On XLA:CPU a call may also run the
    program before it returns, so chains measure compute there, not launches.)

    Example:
        >>> costs = jax_call_costs(rounds=3, arities=[(1, 1), (1, 4)], chains=[1])
        >>> sorted(costs), all(us > 0 for us in costs.values())
        (['chain 1', 'in 1 out 1', 'in 1 out 4'], True)
    """
    devices = list(devices or jax.devices()[:1])
    mesh = jax.make_mesh((len(devices),), ("all",), axis_types=(AxisType.Auto,), devices=devices)
    replicated = NamedSharding(mesh, PartitionSpec())

    def issue_us(compiled: Any, args: list[Any]) -> float:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            out = compiled(*args)
            times.append(time.perf_counter() - start)
            jax.block_until_ready(out)
        return 1e6 * _common.median(times)

    def compiled(fn: Callable[..., Any], args: list[Any]) -> Any:
        return jax.jit(fn, out_shardings=replicated).lower(*args).compile()

    costs = {}
    for n_in, n_out in arities:
        args = jax.device_put([jnp.full((64, 64), float(i)) for i in range(n_in)], replicated)

        def scaled_sums(*xs: Any, n_out: int = n_out) -> list[Any]:
            total = sum(xs)
            return [total * (k + 1) for k in range(n_out)]

        costs[f"in {n_in} out {n_out}"] = issue_us(compiled(scaled_sums, args), args)
    x = jax.device_put(jnp.ones((256, 256)), replicated)
    for k in chains:

        def chain(x: Any, k: int = k) -> Any:
            for _ in range(k):
                x = jnp.tanh(x @ x) + 1.0
            return x

        costs[f"chain {k}"] = issue_us(compiled(chain, [x]), [x])
    return costs
