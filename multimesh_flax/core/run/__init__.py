"""Stage 5, compile and dispatch: one cached ``jax.jit`` per distinct fragment (``_compile``,
keyed by ``trace._structure``), a flat op list dispatched in schedule order (``_dispatch``), and
recorded timelines (``_timeline_plot``)."""
