"""The one contract in code (docs/design.md, "The one contract"): every api module and every
kernels module follows it, so a new operator cannot quietly grow a sixth variant of the path."""

import importlib
import inspect
import pkgutil
import typing

import numpy as np
import pytest

import fastbwd
from fastbwd import api, kernels
from fastbwd.api import _contract, _plans

API_MODULES = [m.name for m in pkgutil.iter_modules(api.__path__) if not m.name.startswith("_")]
KERNEL_MODULES = [m.name for m in pkgutil.iter_modules(kernels.__path__) if not m.name.startswith("_")]
PUBLIC = [name for name in fastbwd.__all__ if name.endswith("_backward") or name == "group_norm_swish"]


def test_the_modules_are_the_five_operators():
    operators = ["avg_pool2d", "group_norm_swish", "replication_pad2d", "roi_align", "upsample_bilinear2d"]
    assert sorted(API_MODULES) == sorted(KERNEL_MODULES) == operators


@pytest.mark.parametrize("name", API_MODULES)
def test_every_api_module_has_operations_and_the_bridges_entry_points(name):
    module = importlib.import_module(f"fastbwd.api.{name}")
    operations = [value for value in vars(module).values() if isinstance(value, _contract.Operation)]
    assert operations, f"{name}: no Operation"
    for operation in operations:
        function = operation.function
        assert function is not None and function.__name__ == operation.name
        assert function.operation is operation and callable(function.prepare)
        assert _contract.OPERATIONS[operation.name] is operation
        parameters = inspect.signature(function).parameters
        assert list(operation.arrays) == [p for p in parameters if p in operation.arrays]
        assert set(operation.scalars) <= set(parameters)
        # the one layout argument, keyword-only, and out=
        assert parameters["layout"].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters["out"].kind is inspect.Parameter.KEYWORD_ONLY
        # the one table of plans: the operation's own (no module keeps another)
        assert isinstance(operation.plans, _plans.Plans)
    assert not [value for value in vars(module).values() if isinstance(value, _plans.Plans)]
    # what the bridges call
    assert callable(module.plan) and callable(module.run)


def test_every_public_function_is_an_operation():
    assert sorted(PUBLIC) == sorted(
        [
            "upsample_bilinear2d_backward",
            "avg_pool2d_backward",
            "replication_pad2d_backward",
            "roi_align_backward",
            "group_norm_swish_backward",
            "group_norm_swish",
        ]
    )
    for name in PUBLIC:
        function = getattr(fastbwd, name)
        assert _contract.OPERATIONS[name].function is function


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_every_kernels_module_has_geometry_and_plan(name):
    module = importlib.import_module(f"fastbwd.kernels.{name}")
    assert issubclass(module.Geometry, tuple) and hasattr(module.Geometry, "_fields")  # a NamedTuple
    assert module.Geometry.__doc__
    assert list(inspect.signature(module.plan).parameters) == ["geometry"]
    forward = getattr(module, "ForwardGeometry", None)
    if forward is not None:
        assert hasattr(forward, "_fields")
    assert not hasattr(module, "BackwardGeometry")  # the backward's is Geometry


def _calls():
    """One small call of every operation (the registry's self-checks' sizes)."""
    rng = np.random.default_rng(0)
    f32 = np.float32
    boxes = np.array([[0, 1, 1, 6, 5], [1, -2, 0, 3, 9]], f32)
    x = rng.standard_normal((2, 4, 3, 3)).astype(f32)
    gamma, beta = np.ones(4, f32), np.zeros(4, f32)
    _, mean, rstd = fastbwd.group_norm_swish(x, gamma, beta, 2)
    from fastbwd.api.roi_align import roi_align_forward

    return {
        "upsample_bilinear2d_backward": lambda: fastbwd.upsample_bilinear2d_backward(
            rng.standard_normal((1, 2, 6, 8)).astype(f32), (6, 8), (1, 2, 3, 4), False
        ),
        "avg_pool2d_backward": lambda: fastbwd.avg_pool2d_backward(
            rng.standard_normal((1, 2, 2, 3)).astype(f32), (1, 2, 4, 6), 2
        ),
        "replication_pad2d_backward": lambda: fastbwd.replication_pad2d_backward(
            rng.standard_normal((1, 2, 6, 7)).astype(f32), (1, 2, 4, 5), (1, 1, 1, 1)
        ),
        "roi_align_backward": lambda: fastbwd.roi_align_backward(
            rng.standard_normal((2, 3, 2, 2)).astype(f32), boxes, (2, 3, 8, 8), 2, 2, 1.0, 0, True
        ),
        "roi_align_forward": lambda: roi_align_forward(
            rng.standard_normal((2, 3, 8, 8)).astype(f32), boxes, 2, 2, 1.0, 0, True
        ),
        "group_norm_swish_backward": lambda: fastbwd.group_norm_swish_backward(x, mean, rstd, x, gamma, beta, 2),
        "group_norm_swish": lambda: fastbwd.group_norm_swish(x, gamma, beta, 2),
    }


@pytest.mark.parametrize("name", sorted(_contract.OPERATIONS))
def test_every_plan_follows_the_protocol(name):
    """An api plan holds its results (one _dtypes.Result each: the one allocation path), its
    kernels' plan and ``run``; the kernels' plan has ``run`` and is its module's plan class."""
    operation = _contract.OPERATIONS[name]
    operation.plans.clear()
    _calls()[name]()
    (plan,) = operation.plans._plans.values()
    assert callable(plan.run) and callable(plan.out_entries)
    assert plan.results and all(isinstance(result, fastbwd._dtypes.Result) for result in plan.results)
    kernel_plan = plan.kernels
    assert callable(kernel_plan.run)
    assert type(kernel_plan).__name__.endswith("Plan")
    module = inspect.getmodule(type(kernel_plan))
    assert module.__name__.startswith("fastbwd.kernels.")
    # the api's plan: a NamedTuple (immutable, shared between threads)
    assert isinstance(plan, tuple) and typing.NamedTuple in getattr(type(plan), "__orig_bases__", ())
