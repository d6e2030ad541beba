"""Stage 6, front doors: ``jit`` (``_jit``: trace, partition, compile and call, cached per
signature), ``parallelize`` (``_parallelize``: shardings for initialisers and steps) and
``task(fun)`` (``_task_function``)."""
