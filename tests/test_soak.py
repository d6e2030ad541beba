"""Soak: 150 pipelined training steps leak neither device buffers nor host memory.

The tiny GPT runs pipelined over 2 stages x (2 data x 2 model) devices, 2 microbatches under
1F1B, for 150 steps, blocking on every step (XLA's CPU collectives deadlock when about a
hundred multi-device calls queue up). Every 100th step (0 and 100) is recorded into a
timeline that is then dropped. After a 50-step warm-up and at the end (100 steps later) the
test samples

* the live device buffers (``jax.live_arrays()``): must be exactly equal;
* the Python objects the garbage collector tracks: at most 50 more (a coarse check: on the
  2-core host the count fell by about 350 between the two samples, so one leaked list per
  step, 100 in all, still passed; leaks that hold arrays or bookkeeping fail the exact checks);
* the runtime's bookkeeping (compiled programs, fragment cache, registered microbatch calls,
  per-trace task state) and the recording slot of ``record_timeline``: must not grow;
* the process's resident memory. Measured growth over 450 steps (of an earlier 500-step
  version) on the 2-core CPU host: 7 to 14 MiB, front-loaded (allocator arenas warming up:
  about half of it in the first 50 steps after warm-up, about 1 MiB per 100 steps at the
  end). The bound, 48 MiB, is over three times that; one leaked copy of the training state
  per step (parameters and momentum, about 1 MiB) would add some 100 MiB over the 100
  sampled steps, and leaked arrays of any size already fail the first check.

It takes about 15 s on that host (150 steps of 20-70 ms plus compilation), so it runs in the
default suite. (It ran 300 steps before; 100 sampled steps still put one leaked training
state per step at twice the RSS bound, and the other checks are exact.)
"""

from __future__ import annotations

import gc
import os

import jax
import numpy as np
import optax
import pytest

import multimesh_flax as mm
from models import GPT, cross_entropy_loss, get_config
from models.pipeline import make_multimesh
from multimesh_flax.core.declare import _thread
from multimesh_flax.core.run import _compile
from multimesh_flax.core.trace import _session

STEPS = 150
WARMUP = 50
TIMELINE_EVERY = 100
RSS_BOUND_MIB = 48


def _loss_fn(model_fn, batch):
    return cross_entropy_loss(model_fn(batch["inputs"]), batch["targets"])


def _batch(seed):
    tokens = jax.random.randint(jax.random.key(seed), (8, 33), 0, 259)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _rss_mib() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:  # not Linux: the other checks still run
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sample(step_fn, state, batch) -> dict:
    gc.collect()
    return {
        "live_arrays": len(jax.live_arrays()),
        "gc_objects": len(gc.get_objects()),
        "rss_mib": _rss_mib(),
        "compiled_programs": step_fn.jitted.cache_size(),
        "compiled_fragments": step_fn.executable(state, batch).compile_count(),
        "fragment_cache": len(_compile._FRAGMENT_CACHE),
        # What traces learn lives on their TraceSession: none may outlive its program.
        "trace_sessions": sum(isinstance(o, _session.TraceSession) for o in gc.get_objects()),
    }


@pytest.mark.heavy
def test_150_pipelined_steps_do_not_leak():
    batches = [_batch(0), _batch(1)]
    step, state, _ = mm.parallelize_step(
        GPT(get_config("gpt-tiny"), stages=2),
        optax.adamw(1e-3),
        make_multimesh(2, 2, 2),
        batches[0],
        loss_fn=_loss_fn,
        microbatches=2,
        schedule="1f1b",
    )
    recorded = []
    for i in range(STEPS):
        batch = batches[i % 2]
        if i % TIMELINE_EVERY == 0:
            with mm.record_timeline() as timeline:
                loss, state = step(state, batch)
            recorded.append(len(timeline.events))
            del timeline
        else:
            loss, state = step(state, batch)
        loss.block_until_ready()
        if i + 1 == WARMUP:
            warm = _sample(step, state, batch)
    end = _sample(step, state, batch)

    assert np.isfinite(float(loss))
    assert _thread.STATE.timeline is None
    assert len(set(recorded)) == 1 and recorded[0] > 0  # every timeline saw the whole step
    rss_warm, rss_end = warm.pop("rss_mib"), end.pop("rss_mib")
    objects_warm, objects_end = warm.pop("gc_objects"), end.pop("gc_objects")
    assert end == warm  # live buffers and bookkeeping: exactly flat
    assert objects_end - objects_warm < 50
    if rss_warm is not None:
        assert rss_end - rss_warm < RSS_BOUND_MIB, (rss_warm, rss_end)
