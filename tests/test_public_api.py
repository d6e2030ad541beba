"""Pins the public names of ``multimesh_flax`` and the shape of its error classes."""

import importlib
import inspect

import pytest

import multimesh_flax
from multimesh_flax import errors

PUBLIC_NAMES = [
    "Context",
    "MultiMesh",
    "Schedule",
    "ScheduleOp",
    "SimulationResult",
    "Task",
    "TaskMesh",
    "Timeline",
    "TimelineEvent",
    "autoshard",
    "checkpoint",
    "context",
    "core",
    "enable_fast_path",
    "enable_recomputation",
    "errors",
    "ignore_transforms",
    "jit",
    "layers",
    "logical_to_mesh_spec",
    "make_schedule",
    "measured_costs",
    "microbatch",
    "parallelize",
    "parallelize_step",
    "plot_timeline",
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


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_public_name_is_importable(name):
    module = importlib.import_module("multimesh_flax")
    assert getattr(module, name) is not None
    namespace = {}
    exec(f"from multimesh_flax import {name}", namespace)
    assert namespace[name] is getattr(module, name)


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


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_error_class_has_a_docstring(cls):
    assert cls.__doc__ and cls.__doc__.strip()


@pytest.mark.parametrize(
    "cls",
    [c for c in _error_classes() if c is not errors.MultiMeshError],
    ids=lambda c: c.__name__,
)
def test_error_class_is_a_value_or_type_error(cls):
    assert issubclass(cls, (ValueError, TypeError))
    assert issubclass(cls, errors.MultiMeshError)
    assert cls.__name__.endswith("Error")


def test_base_error_groups_the_others():
    # The base class is never raised itself (it subclasses only Exception); it groups the
    # others, each of which is a ValueError or TypeError.
    assert issubclass(errors.MultiMeshError, Exception)
    assert errors.MultiMeshError.__subclasses__()
