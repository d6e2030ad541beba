"""Pins the public names of ``multimesh_flax`` and the shape of its error classes."""

import importlib
import inspect

import multimesh_flax
from multimesh_flax import errors

PUBLIC_NAMES = [
    "Context",
    "DeviceSpec",
    "MultiMesh",
    "PipelineOptions",
    "Plan",
    "Plans",
    "Prediction",
    "Schedule",
    "ScheduleOp",
    "SimulationResult",
    "Task",
    "TaskMesh",
    "Timeline",
    "TimelineEvent",
    "UnitProfile",
    "autoshard",
    "checkpoint",
    "context",
    "core",
    "enable_compilation_cache",
    "enable_fast_path",
    "enable_recomputation",
    "errors",
    "ignore_transforms",
    "jit",
    "layers",
    "logical_to_mesh_spec",
    "make_schedule",
    "measure_transfer",
    "measured_costs",
    "microbatch",
    "parallelize",
    "parallelize_step",
    "plan",
    "planner",
    "plot_timeline",
    "predict",
    "profile_units",
    "record_timeline",
    "recorded_bubble",
    "register_task",
    "shard_axes",
    "simulate",
    "slice_global_mesh",
    "tabulate",
    "task",
    "validate_schedule",
    "with_sharding_constraint",
]


def test_all_is_pinned():
    assert sorted(multimesh_flax.__all__) == PUBLIC_NAMES
    assert len(set(multimesh_flax.__all__)) == len(multimesh_flax.__all__)


def test_public_names_are_importable():
    # One test for all names (a failure lists every broken one), not one item per name.
    module = importlib.import_module("multimesh_flax")
    broken = []
    for name in PUBLIC_NAMES:
        namespace = {}
        exec(f"from multimesh_flax import {name}", namespace)
        if getattr(module, name, None) is None or namespace[name] is not getattr(module, name):
            broken.append(name)
    assert not broken


WARNING_CLASSES = ["PlacementWarning"]


def _error_classes():
    return [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if obj.__module__ == errors.__name__ and obj.__name__ not in WARNING_CLASSES
    ]


def test_warning_classes_are_pinned():
    warning_classes = [
        name
        for name, obj in inspect.getmembers(errors, inspect.isclass)
        if obj.__module__ == errors.__name__ and issubclass(obj, Warning)
    ]
    assert warning_classes == WARNING_CLASSES
    assert issubclass(errors.PlacementWarning, UserWarning)
    assert errors.PlacementWarning.__doc__.strip()
    assert not issubclass(errors.PlacementWarning, errors.MultiMeshError)


def test_errors_module_defines_classes():
    assert len(_error_classes()) >= 10


def test_error_classes_have_docstrings():
    assert not [c.__name__ for c in _error_classes() if not (c.__doc__ or "").strip()]


def test_error_classes_are_value_or_type_errors():
    def wrong(cls):
        return not (
            issubclass(cls, (ValueError, TypeError))
            and issubclass(cls, errors.MultiMeshError)
            and cls.__name__.endswith("Error")
        )

    others = [c for c in _error_classes() if c is not errors.MultiMeshError]
    assert not [c.__name__ for c in others if wrong(c)]


def test_base_error_groups_the_others():
    # The base class is never raised itself (it subclasses only Exception); it groups the
    # others, each of which is a ValueError or TypeError.
    assert issubclass(errors.MultiMeshError, Exception)
    assert errors.MultiMeshError.__subclasses__()
