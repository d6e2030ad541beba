"""Stage 2, trace and colour: capture the program once and label every equation by task.

``_trace.trace_program`` runs ``jax.make_jaxpr`` inside a trace session (``_session``: what one
trace learns), inlines nested calls, and colours each equation with its task and phase
(``_colour`` for name-registered tasks); ``_blocks`` keeps each microbatch's copy of a body
traced once as a few call equations. While tracing, ``_constraints`` resolves logical
sharding constraints and ``_microbatch`` hands JAX each microbatch loop as one ``scan``, which
the inliner unrolls per microbatch (``_loops``). ``_structure`` compares jaxprs and equations
by structure (the fragment cache's keys, identical microbatch copies).
"""
