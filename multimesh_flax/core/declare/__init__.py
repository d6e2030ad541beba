"""Stage 1, declarations: what the user says before anything is traced.

Meshes and devices (``_devices``, ``_multimesh``), tasks (``_task``), name-based registration
and contexts (``_registry``), logical rules (``_rules``), pipeline schedules (``_schedules``),
flags and ``context`` (``_config``), placement warnings (``_warnings``). Nothing here imports a
later stage.
"""
