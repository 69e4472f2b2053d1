"""The bridges' one decision, ``fastbwd._dispatch`` (docs/semantics.md §7, docs/design.md "Never
slower"): the same side for the same call in every process, each threshold honoured at its edge,
the policies, FASTBWD_POLICY, and the stored table (used when it is this machine's; ignored when
unreadable, malformed or stale; a read-only folder never fails a decision)."""

import contextlib
import json
import subprocess
import sys
import textwrap

import pytest

from fastbwd import _dispatch

from conftest import child_environment

POOL_1, POOL_2 = _dispatch.DEFAULTS["torch/routed/avg_pool2d/1"], _dispatch.DEFAULTS["torch/routed/avg_pool2d/2"]

#: Calls described as a bridge describes them, around every default threshold.
DESCRIPTIONS = [
    (bridge, path, op, elements, dtype, layout, threads)
    for key, value in sorted(_dispatch.DEFAULTS.items())
    for bridge, path, op, threads in [key.split("/")]
    for elements in (0, 1, value - 1, value, value + 1, 10**8)
    for dtype, layout in (("float32", "NCHW"), ("bfloat16", "NHWC"))
    for threads in (int(threads), int(threads) + 2)
]


@pytest.fixture
def table_folder(tmp_path, monkeypatch):
    """A stored table's folder of the test's own (NUMBA_CACHE_DIR), read afresh before and after."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    _dispatch.forget()
    yield tmp_path
    monkeypatch.undo()
    _dispatch.forget()


def run(code, **environment):
    """``code``'s standard output in a new process (fastbwd from this checkout)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=child_environment(**environment),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_each_threshold_is_honoured_at_its_edge(table_folder):
    for key, value in _dispatch.DEFAULTS.items():
        bridge, path, op, threads = key.split("/")
        threads = int(threads)
        assert _dispatch.threshold(bridge, path, op, threads=threads) == value
        assert not _dispatch.decide("auto", bridge, path, op, value - 1, threads=threads), key
        assert _dispatch.decide("auto", bridge, path, op, value, threads=threads), key
        assert _dispatch.decide("always", bridge, path, op, 0, threads=threads), key


def test_a_call_split_into_fewer_tasks_than_threads_is_the_frameworks(table_folder):
    """Under "auto" a call whose kernels leave threads idle (fewer tasks than threads) runs the
    framework's code whatever its size; enough tasks (or None: not known) leave the threshold
    to decide; "always" takes fastbwd's side."""
    for key, value in _dispatch.DEFAULTS.items():
        bridge, path, op, threads = key.split("/")
        threads = int(threads)
        for size in (value, 10**9):
            assert not _dispatch.decide("auto", bridge, path, op, size, threads=threads, tasks=threads - 1), key
            assert _dispatch.decide("auto", bridge, path, op, size, threads=threads, tasks=threads), key
            assert _dispatch.decide("auto", bridge, path, op, size, threads=threads, tasks=None), key
            assert _dispatch.decide("always", bridge, path, op, size, threads=threads, tasks=0), key
        assert not _dispatch.decide("auto", bridge, path, op, value - 1, threads=threads, tasks=threads + 5), key
    assert not _dispatch.decide("auto", "torch", "dropin", "group_norm_swish", 10**9, threads=8, tasks=7)


def test_more_threads_take_the_two_thread_thresholds(table_folder):
    with _dispatch.using({"torch/routed/avg_pool2d/1": 10, "torch/routed/avg_pool2d/2": 1000}):
        assert _dispatch.decide("auto", "torch", "routed", "avg_pool2d", 500, threads=1)
        for threads in (2, 3, 64):
            assert not _dispatch.decide("auto", "torch", "routed", "avg_pool2d", 999, threads=threads)
            assert _dispatch.decide("auto", "torch", "routed", "avg_pool2d", 1000, threads=threads)


def test_a_key_refined_by_dtype_and_layout_wins(table_folder):
    thresholds = {"torch/routed/avg_pool2d/1": 100, "torch/routed/avg_pool2d/1/bfloat16": 10}
    thresholds["torch/routed/avg_pool2d/1/bfloat16/NHWC"] = 1
    with _dispatch.using(thresholds):
        assert _dispatch.threshold("torch", "routed", "avg_pool2d", "float32", "NCHW", 1) == 100
        assert _dispatch.threshold("torch", "routed", "avg_pool2d", "bfloat16", "NCHW", 1) == 10
        assert _dispatch.threshold("torch", "routed", "avg_pool2d", "bfloat16", "NHWC", 1) == 1
        assert _dispatch.floor("torch", "routed", "avg_pool2d", 1) == 1
        assert _dispatch.floor("torch", "routed", "avg_pool2d", 2) == POOL_2
    assert _dispatch.threshold("torch", "routed", "avg_pool2d", "bfloat16", "NHWC", 1) == POOL_1


def test_floor_is_the_least_threshold_of_a_path_and_thread_count(table_folder):
    for path in ("routed", "fused", "compiled"):
        for op in _dispatch.OPS:
            for threads in (1, 2, 3):
                values = [v for k, v in _dispatch.DEFAULTS.items() if k == _dispatch.key("torch", path, op, threads)]
                assert _dispatch.floor("torch", path, op, threads) == (min(values) if values else 0)


def test_a_floor_takes_the_refined_keys_of_its_thread_count_only(table_folder):
    thresholds = {"torch/routed/avg_pool2d/1": 100, "torch/routed/avg_pool2d/2": 300}
    thresholds["torch/routed/avg_pool2d/2/bfloat16"] = 200
    thresholds["torch/routed/avg_pool2d/1/float16/NHWC"] = 50
    with _dispatch.using(thresholds):
        floors = _dispatch.floors_of("torch", "routed", "avg_pool2d")
        assert [_dispatch.floor("torch", "routed", "avg_pool2d", t) for t in (1, 2, 4)] == [50, 200, 200]
        assert floors == {1: 50, 2: 200, 4: 200}  # kept for a bridge's own reading, by thread count
    assert floors == {} and _dispatch.floors_of("torch", "routed", "avg_pool2d") is floors  # the same dict, emptied
    assert _dispatch.floor("torch", "routed", "avg_pool2d", 2) == POOL_2


def test_a_stored_calibration_empties_the_floors_the_bridges_hold(table_folder):
    floors = _dispatch.floors_of("torch", "routed", "avg_pool2d")
    assert _dispatch.floor("torch", "routed", "avg_pool2d", 1) == POOL_1 and floors == {1: POOL_1}
    _dispatch.store({"torch/routed/avg_pool2d/1": 480})
    assert floors == {}  # the same dict, which a bridge reads directly
    assert _dispatch.floor("torch", "routed", "avg_pool2d", 1) == 480 and floors == {1: 480}


def test_a_call_nothing_was_measured_for_stays_fastbwds(table_folder):
    assert _dispatch.threshold("torch", "routed", "roi_align", threads=1) == 0
    assert _dispatch.decide("auto", "torch", "routed", "roi_align", 1)


def _decisions(descriptions):
    return [_dispatch.decide("auto", *description) for description in descriptions]


def test_the_same_call_goes_the_same_way_in_every_process(table_folder):
    here = _decisions(DESCRIPTIONS)
    assert here == _decisions(DESCRIPTIONS)  # and again in this process
    code = f"""
        import json
        from fastbwd import _dispatch
        print(json.dumps([_dispatch.decide("auto", *d) for d in {DESCRIPTIONS!r}]))
    """
    for _ in range(2):
        assert json.loads(run(code, NUMBA_CACHE_DIR=str(table_folder))) == here
    assert True in here and False in here


def test_policies_and_the_environment_variable():
    assert _dispatch.POLICIES == ("auto", "always")
    assert _dispatch.check_policy("auto") == "auto"
    with pytest.raises(ValueError, match="'auto', 'always'"):
        _dispatch.check_policy("fast")
    code = "from fastbwd import _dispatch; print(_dispatch.default_policy())"
    assert run(code, FASTBWD_POLICY="always").strip() == "always"
    assert run(code, FASTBWD_POLICY="Auto ").strip() == "auto"
    assert run(code, FASTBWD_POLICY="").strip() == "auto"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=child_environment(without=["FASTBWD_POLICY"]),
        timeout=300,
    )
    assert done.stdout.strip() == "auto"
    warned = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True,
        text=True,
        env=child_environment(FASTBWD_POLICY="sometimes"),
        timeout=300,
    )
    assert warned.stdout.strip() == "auto" and "FASTBWD_POLICY='sometimes'" in warned.stderr


# ---- the stored table ------------------------------------------------------------------------


def _table(**changes):
    table = {
        "format": _dispatch.FORMAT,
        "machine": _dispatch.machine(),
        "frameworks": {"torch": _dispatch.framework_version("torch"), "jax": _dispatch.framework_version("jax")},
        "thresholds": {"torch/routed/avg_pool2d/1": 7, "jax/traced/avg_pool2d/1": 9},
    }
    for name, value in changes.items():
        if isinstance(value, dict) and isinstance(table.get(name), dict):
            table[name] = {**table[name], **value}
        else:
            table[name] = value
    return table


def _write(folder, table):
    path = folder / "fastbwd-dispatch.json"
    if isinstance(table, bytes):
        path.write_bytes(table)
    else:
        path.write_text(table if isinstance(table, str) else json.dumps(table))
    _dispatch.forget()
    return path


def test_a_stored_table_of_this_machine_is_used(table_folder):
    path = _write(table_folder, _table())
    assert _dispatch.table_path() == str(path)
    assert _dispatch.status() == f"used: {path}"
    assert _dispatch.threshold("torch", "routed", "avg_pool2d", threads=1) == 7
    assert _dispatch.decide("auto", "torch", "routed", "avg_pool2d", 7, threads=1)
    assert not _dispatch.decide("auto", "torch", "routed", "avg_pool2d", 6, threads=1)
    assert _dispatch.threshold("torch", "routed", "avg_pool2d", threads=2) == POOL_2  # not stored: the default
    assert _dispatch.threshold("jax", "traced", "avg_pool2d", threads=1) == 9


@pytest.mark.parametrize(
    "table, why",
    [
        ("{not json", "is not JSON"),
        (b'\xff{"format": 1}', "is not JSON"),  # not UTF-8 text: a damaged file
        ("[]", "lacks format"),
        (_table(thresholds=[1, 2]), "thresholds that are not an object"),
        (_table(thresholds={"torch/routed/avg_pool2d/1": -3}), "not a size"),
        (_table(thresholds={"torch/routed/avg_pool2d/1": 2.5}), "not a size"),
        (_table(thresholds={"torch/routed/avg_pool2d/1": True}), "not a size"),
        (_table(thresholds={"torch/nowhere/avg_pool2d/1": 3}), "unknown threshold"),
        (_table(format=_dispatch.FORMAT + 1), "has format"),
        (_table(machine={"fastbwd": "0.0.1"}), "measured with fastbwd"),
        (_table(machine={"cpu": "another processor"}), "measured with cpu"),
        (_table(machine={"cpus": 512}), "measured with cpus"),
        (_table(machine=[]), "not an object"),
    ],
)
def test_a_malformed_or_stale_table_is_ignored(table_folder, table, why):
    path = _write(table_folder, table)
    assert _dispatch.status().startswith(f"ignored: {path}") and why in _dispatch.status(), _dispatch.status()
    assert _dispatch.stored() == {}
    assert _dispatch.threshold("torch", "routed", "avg_pool2d", threads=1) == POOL_1  # the defaults decide
    assert _dispatch.decide("auto", "torch", "routed", "avg_pool2d", POOL_1, threads=1)
    assert not _dispatch.decide("auto", "torch", "routed", "avg_pool2d", POOL_1 - 1, threads=1)


def test_a_table_of_another_framework_version_keeps_only_the_other_bridges(table_folder):
    _write(table_folder, _table(frameworks={"torch": "0.1.0"}))
    assert _dispatch.status().startswith("used")
    assert _dispatch.threshold("torch", "routed", "avg_pool2d", threads=1) == POOL_1
    assert _dispatch.threshold("jax", "traced", "avg_pool2d", threads=1) == 9


def test_an_unreadable_table_is_ignored(table_folder):
    (table_folder / "fastbwd-dispatch.json").mkdir()  # a folder where the file should be
    _dispatch.forget()
    assert _dispatch.status().startswith("ignored") and "cannot be read" in _dispatch.status()
    assert _dispatch.decide("auto", "torch", "routed", "avg_pool2d", POOL_1, threads=1)


def test_no_table_means_the_defaults(table_folder):
    assert _dispatch.status() == "none"
    assert (
        _dispatch.threshold("torch", "fused", "group_norm_swish", threads=2)
        == (_dispatch.DEFAULTS["torch/fused/group_norm_swish/2"])
    )


def test_store_writes_a_table_that_is_read_back(table_folder):
    path = _dispatch.store({"torch/routed/replication_pad2d/2": 123})
    assert _dispatch.status() == f"used: {path}"
    assert _dispatch.threshold("torch", "routed", "replication_pad2d", threads=2) == 123
    _dispatch.store({"torch/routed/replication_pad2d/1": 45})  # merged with what is stored
    assert _dispatch.threshold("torch", "routed", "replication_pad2d", threads=2) == 123
    assert _dispatch.threshold("torch", "routed", "replication_pad2d", threads=1) == 45
    with open(path) as handle:
        stored = json.load(handle)
    assert stored["machine"] == _dispatch.machine() and stored["frameworks"]["torch"] == (
        _dispatch.framework_version("torch")
    )
    with pytest.raises(ValueError, match="unknown threshold"):
        _dispatch.store({"torch/routed/nothing/1": 1})


def test_a_read_only_folder_fails_only_the_calibration(monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/proc/self")  # not writable, even by root
    _dispatch.forget()
    try:
        with pytest.raises(OSError):
            _dispatch.store({"torch/routed/replication_pad2d/2": 123})
        assert _dispatch.status() == "none"
        pad = _dispatch.DEFAULTS["torch/routed/replication_pad2d/2"]
        assert _dispatch.decide("auto", "torch", "routed", "replication_pad2d", pad, threads=2)
        assert not _dispatch.decide("auto", "torch", "routed", "replication_pad2d", pad - 1, threads=2)
    finally:
        monkeypatch.undo()
        _dispatch.forget()


def test_using_sets_thresholds_for_a_block_and_restores_the_table(table_folder):
    _write(table_folder, _table())
    with _dispatch.using({"torch/routed/avg_pool2d/1": 0}):
        assert _dispatch.decide("auto", "torch", "routed", "avg_pool2d", 1, threads=1)
        assert _dispatch.floor("torch", "routed", "avg_pool2d", 1) == 0
    assert _dispatch.threshold("torch", "routed", "avg_pool2d", threads=1) == 7
    assert _dispatch.status().startswith("used")


def test_alternating_ratio_times_the_sides_in_alternating_rounds(monkeypatch):
    """Both calibrations' measuring loop on a clock the steps move (fastbwd's step 1 s, the
    framework's 3 s): each side runs once to warm, fastbwd's once more to size the rounds, then
    ``rounds`` rounds of ``calls`` each, one side after the other, each batch inside its own
    context; the ratio is the framework's time over fastbwd's."""
    clock, events = [0.0], []
    monkeypatch.setattr(_dispatch.time, "perf_counter", lambda: clock[0])

    def step(name, seconds):
        def run():
            events.append(name)
            clock[0] += seconds

        return run

    @contextlib.contextmanager
    def fastbwd_side():
        events.append("enter")
        yield
        events.append("exit")

    steps = (step("fastbwd", 1.0), step("framework", 3.0))
    # seconds / rounds / 2 / 1 s per call: 2 calls a side a round
    assert _dispatch.alternating_ratio(steps, (fastbwd_side, None), seconds=12.0, rounds=3) == 3.0
    warm = ["enter", "fastbwd", "exit", "framework", "enter", "fastbwd", "exit"]
    one_round = ["enter", "fastbwd", "fastbwd", "exit", "framework", "framework"]
    assert events == warm + one_round * 3
