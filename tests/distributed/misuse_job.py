"""One process of a misused 2-process job (run by ``launch``; see test_misuse.py).

``python misuse_job.py MODE OUT_DIR``, every MODE runs the two-submesh MLP of ``mp_models``
(stage 1 on process 0's devices, stage 2 on process 1's):

* ``extra_step``: process 1 runs a third step after process 0 stopped after two;
* ``host_values_one``: only process 0 reads the loss (held by process 1) with ``host_values``;
* ``save_one``: only process 0 saves a checkpoint;
* ``seeds``: each process draws the global batch with its own seed;
* ``seeds_late_in_R``: as ``seeds``, and process R takes 1 s to unwind its error (a slow
  ``except``), so it reads the other process's failure while still failing itself;
* ``seeds_slow_exit_in_R``: as ``seeds``, and an exit handler of process R takes 2.5 s (more
  than ``PEER_GRACE_S``) before jax's shutdown runs;
* ``raise_in_R``: process R raises before step 2, while the other waits in step 2;
* ``interrupt_in_R``: the same with ``KeyboardInterrupt`` (a Ctrl-C that reached process R).
"""

import atexit
import os
import sys
import time

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from multimesh_flax.distributed import initialize

    initialize(heartbeat_timeout=5)
    import jax
    import mp_models
    import numpy as np

    import multimesh_flax as mm
    from multimesh_flax import errors
    from multimesh_flax.distributed import host_values

    mode, out_dir = sys.argv[1], sys.argv[2]
    rank = jax.process_index()
    step, init = mp_models.make_step(4)
    x = mp_models.batch()
    if mode.startswith("seeds"):
        x = np.random.default_rng(rank).normal(size=x.shape).astype(x.dtype)
    if mode == f"seeds_slow_exit_in_{rank}":
        atexit.register(time.sleep, 2.5)  # runs before jax's exit handler, registered earlier
    sharded_step, init_params = mm.parallelize(step, init_params=init, initial_batch=x)
    params = init_params()
    steps = 3 if mode == "extra_step" and rank == 1 else 2
    for index in range(steps):
        if mode == f"raise_in_{rank}" and index == 1:
            raise RuntimeError(f"raised in process {rank} before step 2")
        if mode == f"interrupt_in_{rank}" and index == 1:
            raise KeyboardInterrupt
        try:
            loss, params = sharded_step(params, x)
        except errors.InputMismatchError:
            if mode == f"seeds_late_in_{rank}":
                time.sleep(1.0)  # more than the records' poll (0.2 s), less than PEER_GRACE_S
            raise
        jax.block_until_ready(params)
    print(f"stepped at {time.time():.3f}", flush=True)
    if rank == 0 and mode == "host_values_one":
        host_values({"loss": loss})
    if rank == 0 and mode == "save_one":
        from multimesh_flax.checkpoint import Checkpointer

        with Checkpointer(os.path.join(out_dir, "ckpt")) as ckpt:
            ckpt.save(1, {"p0": params[0], "p1": params[1]})
    print("finished", flush=True)
