"""Stage 5, compile and dispatch: one cached program per distinct fragment (``_compile``,
keyed by ``trace._structure``), compiled once and relocated to other submeshes
(``_relocate``), a flat op list dispatched in schedule order (``_dispatch``), and recorded
timelines (``_timeline_plot``)."""
