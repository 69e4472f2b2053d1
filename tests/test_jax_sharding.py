"""fastbwd.jax on sharded programs (docs/semantics.md §8): the tests need two devices, which
XLA's CPU client has only when ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` is set
before jax is imported. This session's jax has one, so ``tests/jax_two_devices.py`` runs in a
pytest process of its own with the flag (pytest collects that file only when named); here,
without a second device, the parts that need none: every FFI target has a split, and a
one-device program is the plain FFI call."""

import ast
import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fastbwd.jax as fj  # noqa: E402
from fastbwd.jax import _ffi  # noqa: E402
from fastbwd.testing.checks import bitwise_equal  # noqa: E402

from conftest import child_environment, random  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


#: The libraries some fastbwd.jax modules are built on, optional (the flax and equinox extras).
OPTIONAL_LIBRARIES = ("flax", "equinox")


def _registers_a_target_without_a_split(path):
    """The ``_ffi.target(...)`` calls in the source at ``path`` that give no split, by keyword or
    as the fourth argument (read, not imported: for a module whose library is not installed)."""

    def is_target_call(node):
        function = getattr(node, "func", None)
        return isinstance(node, ast.Call) and getattr(function, "attr", getattr(function, "id", None)) == "target"

    def split_given(call):
        splits = [k.value for k in call.keywords if k.arg == "split"] + call.args[3:4]
        return any(not (isinstance(value, ast.Constant) and value.value is None) for value in splits)

    calls = [node for node in ast.walk(ast.parse(path.read_text())) if is_target_call(node)]
    return [ast.unparse(call) for call in calls if not split_given(call)]


def test_every_operator_target_has_a_split():
    """Every FFI target the operators register tells XLA how to partition it (a new target
    without a split would run whole on every device). A module that needs a library not
    installed here (Flax, Equinox) is read instead of imported: it must register no target
    without a split either."""
    names, unimported = set(), []
    for info in pkgutil.iter_modules(fj.__path__):
        try:
            module = importlib.import_module(f"fastbwd.jax.{info.name}")
        except ModuleNotFoundError as missing:
            assert missing.name.split(".")[0] in OPTIONAL_LIBRARIES, f"fastbwd.jax.{info.name}: {missing}"
            unimported.append(info.name)
            path = Path(fj.__path__[0]) / f"{info.name}.py"
            assert _registers_a_target_without_a_split(path) == [], path
            continue
        names |= {value for value in vars(module).values() if isinstance(value, str) and value in _ffi._targets}
    assert len(names) >= 6, names
    assert sorted(name for name in names if _ffi._splits[name] is None) == []
    assert set(unimported) <= {"linen", "nnx", "equinox"}, unimported


def test_the_split_check_reads_a_module_it_cannot_import(tmp_path):
    """The source check above finds a target registered without a split."""
    module = tmp_path / "library.py"
    module.write_text(
        "import equinox\nfrom . import _ffi\n"
        "A = _ffi.target('a', adapter, fold=True, split=_sharding.planes)\n"
        "B = _ffi.target('b', adapter, fold=True)\nC = _ffi.target('c', adapter, fold=True, split=None)\n"
        "D = _ffi.target('d', adapter, True, _sharding.planes)\n"
    )
    assert _registers_a_target_without_a_split(module) == [
        "_ffi.target('b', adapter, fold=True)",
        "_ffi.target('c', adapter, fold=True, split=None)",
    ]


def test_one_device_program_is_the_plain_ffi_call():
    """On one device the partitioning wrapper lowers to the FFI call alone: no
    CustomSPMDPartitioning call is left for XLA (the persistent compilation cache keys on
    the program text, which then names nothing of this process)."""
    x = jnp.ones((2, 3, 4, 5), jnp.float32)
    text = jax.jit(jax.grad(lambda x: jnp.sum(fj.upsample_bilinear2d(x, (8, 10)) ** 2))).lower(x).as_text()
    assert "CustomSPMDPartitioning" not in text
    assert len(re.findall(r"fastbwd_upsample_bilinear2d_backward", text)) == 1


def test_nested_vmap_loops_each_axis_over_its_own_operands():
    """A looping target (RoIAlign) under two vmaps that batch different operands, the images
    outside and the boxes inside: the loops nest in that order, each over the operands its
    vmap batches, and element (i, j) is the call on images i and boxes j."""
    images = random((2, 2, 3, 8, 8), np.float32, 1)
    # a jnp array: JAX 0.10.2 refuses a NumPy one vmapped inside jit into any custom_vjp
    boxes = jnp.asarray([[[0, 1, 1, 6, 6]], [[1, 0, 0, 7, 5]], [[0, 2, 1, 5, 7]]], jnp.float32)

    def f(x, b):
        return fj.roi_align(x, b, 2)

    nested = jax.jit(jax.vmap(lambda x: jax.vmap(lambda b: f(x, b))(boxes)))(images)
    assert nested.shape == (2, 3, 1, 3, 2, 2)
    for i in range(2):
        for j in range(3):
            assert bitwise_equal(np.asarray(nested[i, j]), np.asarray(f(images[i], boxes[j]))), (i, j)


@pytest.mark.slow
def test_on_two_cpu_devices():
    """tests/jax_two_devices.py in a process with two CPU devices: every case passes."""
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env = child_environment(XLA_FLAGS=flags)  # a pytest of its own, not one of pytest-xdist's workers
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/jax_two_devices.py"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\d+ passed", result.stdout) and "skipped" not in result.stdout, result.stdout[-3000:]
