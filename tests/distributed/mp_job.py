"""One process of the multi-process test job (run by ``launch``; see test_multiprocess.py).

``python mp_job.py OUT_DIR MODE [CKPT]``. MODE ``mlp``: the two-submesh MLP with a second
stage of 4 devices, of 2 devices, and of 4 devices spanning both processes (``-4``); every
process writes what it saw to ``OUT_DIR/rank{r}.npz``; with the 4-device stage it also
restores CKPT (written by one process) and saves its final parameters to ``OUT_DIR/ckpt2``;
with the stage spanning both processes it restores ``ckpt2`` onto that layout and saves its
final parameters to ``OUT_DIR/ckpt3``.
MODE ``mismatch``: process 1 builds a wider model. MODE ``local_values``: each process passes
``host_values`` an array it made on its own device. MODE ``kill``: process 1 kills itself
before step 3, while process 0 may still be in step 2 (its last transfers) or enters step 3.
"""

import os
import signal
import sys
import time

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from multimesh_flax.distributed import initialize

    initialize(heartbeat_timeout=5)
    import jax
    import mp_models
    import numpy as np

    out_dir, mode = sys.argv[1], sys.argv[2]
    rank = jax.process_index()
    if mode == "mlp":
        results = {}
        for second in (4, 2, -4):
            written = os.path.join(out_dir, "ckpt2"), os.path.join(out_dir, "ckpt3")
            ckpts = {4: (sys.argv[3], written[0]), -4: written}.get(second)
            for name, value in mp_models.run_parallel(second, checkpoints=ckpts).items():
                results[f"{second}/{name}"] = value
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
    elif mode == "mismatch":
        mp_models.run_parallel(4, hidden=16 if rank == 0 else 32)
    elif mode == "local_values":
        import jax.numpy as jnp

        from multimesh_flax.distributed import host_values

        host_values({"loss": jnp.float32(rank)})
    elif mode == "kill":
        import multimesh_flax as mm

        step, init = mp_models.make_step(4)
        x = mp_models.batch()
        sharded_step, init_params = mm.parallelize(step, init_params=init, initial_batch=x)
        params = init_params()
        for i in range(10):
            if i == 3 and rank == 1:
                print(f"killing myself at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            loss, params = sharded_step(params, x)
            jax.block_until_ready(params)
    print("finished", flush=True)
