"""fastbwd.precompile / python -m fastbwd --precompile fill the disk cache: a later process
compiles nothing (Numba's compile events and cache statistics, not wall time)."""

import os
import subprocess
import sys

import pytest

import fastbwd
from fastbwd import _precompile
from fastbwd._dtypes import BY_NAME

from conftest import ROOT, child_environment

# Runs every replication_pad2d_backward entry of the precompile table (and a read-only
# grad_output) in a fresh process; prints the number of compiles and of cache hits.
_CHILD = """
import numpy as np
from numba.core import event
import fastbwd
from fastbwd import _precompile
from fastbwd._dtypes import BY_NAME
from fastbwd.kernels import replication_pad2d as k

compiles = []
class Listener(event.Listener):
    def on_start(self, ev):
        pass
    def on_end(self, ev):
        compiles.append(ev.data["dispatcher"].py_func.__name__)
event.register("numba:compile", Listener())
for entry in _precompile.select(ops=["replication_pad2d_backward"], dtypes=["float32", "bfloat16"]):
    entry.call(BY_NAME[entry.dtype])
g = np.ones((1, 2, 7, 8), np.float32)
g.flags.writeable = False
fastbwd.replication_pad2d_backward(g, (1, 2, 4, 5), (1, 2, 2, 1))
hits = sum(sum(twin.stats.cache_hits.values())
           for kernel in (k.replication_pad2d_bwd_nchw, k.replication_pad2d_bwd_nhwc)
           for twin in (kernel.parallel, kernel.serial))
print(len(compiles), hits)
"""


def _run(args, env, **kwargs):
    environment = child_environment(without=("FASTBWD_CACHE", "FASTBWD_SERIAL"), **env)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=environment, cwd=ROOT, timeout=600, **kwargs
    )


@pytest.mark.slow
def test_precompile_fills_the_cache_and_a_new_process_compiles_nothing(tmp_path):
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    command = [
        "-m",
        "fastbwd",
        "--precompile",
        "--ops",
        "replication_pad2d_backward",
        "--dtypes",
        "float32",
        "bfloat16",
    ]
    first = _run(command, env)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    # 6 kernel paths (3 per dtype), each compiled as the parallel kernel and as its serial twin
    assert sum(": compiled replication_pad2d_bwd_" in line for line in lines) == 12, first.stdout
    serial = [line for line in lines if "(serial twin): compiled replication_pad2d_bwd_" in line]
    assert len(serial) == 6 and all("_serial in " in line for line in serial), first.stdout
    assert "12 runs, 12 kernels compiled, 0 errors" in lines[-1]
    # idempotent: a second run finds every kernel in the cache
    second = _run(command, env)
    assert second.returncode == 0, second.stderr
    assert "12 runs, 0 kernels compiled, 0 errors" in second.stdout.splitlines()[-1], second.stdout
    # a new process: every call is served from the cache (the tiny ones by serial twins, the
    # streaming path's 16 MB result by the parallel kernel)
    child = _run(["-c", _CHILD], env)
    assert child.returncode == 0, child.stderr
    compiles, hits = map(int, child.stdout.split())
    assert compiles == 0 and hits == 6


def test_precompile_without_a_cache_compiles_nothing():
    child = _run(
        [
            "-c",
            "import fastbwd; r = fastbwd.precompile(ops='replication_pad2d_backward'); "
            "print(r['compiled'], r['entries'])",
        ],
        {"FASTBWD_CACHE": "0"},
    )
    assert child.returncode == 0, child.stderr
    assert "disk cache is disabled" in child.stdout and child.stdout.split()[-2:] == ["0", "0"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes to read-only folders")
def test_precompile_with_a_read_only_cache_folder_says_so(tmp_path):
    tmp_path.chmod(0o500)
    try:
        child = _run(
            ["-c", "import fastbwd; r = fastbwd.precompile(ops='replication_pad2d_backward'); print(r['compiled'])"],
            {"NUMBA_CACHE_DIR": str(tmp_path / "cache")},
        )
    finally:
        tmp_path.chmod(0o700)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split()[-1] == "0"


def test_table_covers_every_operator_dtype_and_layout():
    ops = {entry.op for entry in _precompile.TABLE}
    assert ops == {
        "upsample_bilinear2d_backward",
        "avg_pool2d_backward",
        "replication_pad2d_backward",
        "roi_align_backward",
        "roi_align_forward",
        "group_norm_swish_backward",
        "group_norm_swish",
    }
    keys = [entry.key for entry in _precompile.TABLE]
    assert len(keys) == len(set(keys))
    pad = {(e.dtype, e.layout, e.path) for e in _precompile.select(ops="replication_pad2d_backward")}
    assert pad == {(dtype, layout, "gather") for dtype in BY_NAME for layout in ("NCHW", "NHWC")} | {
        (dtype, "NCHW", "gather, streaming stores") for dtype in BY_NAME
    }
    with pytest.raises(ValueError, match="unknown dtype"):
        _precompile.select(dtypes=["int8"])
    assert fastbwd.precompile is _precompile.precompile


def test_float32_unless_more_dtypes_are_asked_for(monkeypatch):
    """The default is the float32 entries (a fifth of the table's CPU); "all", alone or in a list,
    is every dtype; ``python -m fastbwd --precompile`` passes --dtypes through as given."""
    assert _precompile.precompile_dtypes(None) == ("float32",) == _precompile.DEFAULT_DTYPES
    assert _precompile.precompile_dtypes("all") is None and _precompile.precompile_dtypes(["all"]) is None
    assert _precompile.precompile_dtypes(["bfloat16"]) == ["bfloat16"]
    default = _precompile.select(dtypes=_precompile.precompile_dtypes(None))
    assert {entry.dtype for entry in default} == {"float32"}
    assert {entry.op for entry in default} == {entry.op for entry in _precompile.TABLE}
    assert len(_precompile.select(dtypes=_precompile.precompile_dtypes("all"))) == len(_precompile.TABLE)
    seen = []
    monkeypatch.setattr(fastbwd, "precompile", lambda *args, **kwargs: seen.append(args) or {"errors": []})
    from fastbwd import __main__ as fastbwd_main

    assert fastbwd_main.main(["--precompile"]) == 0 and fastbwd_main.main(["--precompile", "--dtypes", "all"]) == 0
    assert [dtypes for _, dtypes, _ in seen] == [None, ["all"]]
    with pytest.raises(SystemExit):
        fastbwd_main.main(["--precompile", "--dtypes", "int8"])


def test_the_default_says_what_it_left_out(tmp_path, capsys, monkeypatch):
    """The default's report names the dtypes it did not compile, and how to ask for them."""
    monkeypatch.setattr(_precompile, "cache_folder", lambda: (str(tmp_path), None))
    monkeypatch.setattr(_precompile, "select", lambda ops, dtypes, layouts: [] if dtypes else _precompile.TABLE)
    result = fastbwd.precompile(ops="replication_pad2d_backward")
    out = capsys.readouterr().out
    assert result["entries"] == 0
    line = next(line for line in out.splitlines() if "only (the default)" in line)
    assert line.strip().startswith("float32 only (the default): bfloat16, complex128")
    assert "--dtypes (a list, or all)" in line
