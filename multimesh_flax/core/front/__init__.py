"""Stage 6, front doors: ``jit`` (``_jit``: trace, partition, compile and call, cached per
signature), ``parallelize`` (``_parallelize``: shardings for initialisers and steps;
``_initializer``: initialisers that create each leaf in its sharding) and ``task(fun)``
(``_task_function``, an adapter of ``_task_call``, the one task call of every kind)."""
