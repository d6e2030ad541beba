"""Stage 3, plan: pipeline units, accumulation order and the simulated schedule.

``_pipeline`` groups task equations into units (stage, microbatch, phase) and builds each
region's schedule; ``_accumulate`` re-associates sums over microbatches into that order;
``_simulator`` simulates a schedule (also a public tool).
"""
