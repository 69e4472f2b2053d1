"""Where a bridge's call runs: fastbwd's kernels, or the framework's own code (docs/design.md,
"Never slower"; docs/semantics.md §7 and §8).

One decision for both bridges. A bridge describes a call statically, before any kernel runs (at
trace time in a compiled graph or a JAX program):

* ``bridge``: ``"torch"`` or ``"jax"``;
* ``path``: how the bridge reaches the call (:data:`PATHS`: eager routing, eager fusion, a
  drop-in, a compiled graph, ...), since each path has its own per-call cost;
* ``op``: the operator (:data:`OPS`), forward and backward together, as a training step runs them;
* ``elements``: the number of elements of the forward's input (the size the thresholds count);
* ``dtype`` (a NumPy dtype name), ``layout`` (``"NCHW"`` or ``"NHWC"``) and ``threads`` (the
  thread count the call runs on);
* ``tasks``, where a bridge knows them: the parallel tasks fastbwd's kernels split the call into
  (GroupNorm+Swish: ``fastbwd.api.group_norm_swish.parallel_tasks``);

and :func:`decide` says True (fastbwd's whole path, the bridge's Python included, is the faster
one) or False (the framework's own code runs, giving the framework's bits). Under the policy
``"always"`` every call fastbwd can serve is fastbwd's, as before this module existed.

The crossover is a threshold per (bridge, path, op, thread count), in input elements: fastbwd
from ``elements >= threshold`` on. The defaults (:data:`DEFAULTS`) were measured on the 2-core
AMD EPYC machines fastbwd is developed on (docs/history.md, "Never slower");
``python -m fastbwd --calibrate`` measures this machine's and stores them beside
Numba's cache (:func:`table_path`), where :func:`decide` finds them. A stored table that is
unreadable, malformed or made for another machine, fastbwd or framework version is ignored
(:func:`status` says why); a read-only folder only stops a calibration from storing its table.

The decision depends on nothing measured at call time, so the same call on the same machine
goes the same way in every run. This module imports neither torch nor jax.
"""

import contextlib
import json
import os
import platform
import statistics
import threading
import time

from . import _config
from ._version import __version__

#: The policies (docs/semantics.md §7): "auto" decides per call; "always" sends every call
#: fastbwd can serve to fastbwd (the bits of fastbwd's kernels, for any thread count).
POLICIES = ("auto", "always")

#: How a bridge reaches a call, each with its own per-call cost:
#: routed    an eager functional call (PyTorch: F.interpolate, F.avg_pool2d, F.pad and the modules
#:           that call them), its backward on fastbwd;
#: fused     an eager GroupNorm -> SiLU pair of fuse_group_norm_swish (its lazy output);
#: dropin    a drop-in (PyTorch: fastbwd.torch.group_norm_swish, GroupNormSwish; JAX: fastbwd.jax's
#:           resize, avg_pool, pad and the libraries' GroupNorm, called by the user or by reach,
#:           against the library's own function);
#: compiled  a node of a torch.compile graph;
#: traced    a call of fastbwd.jax's PyTorch-shaped functions (upsample_bilinear2d, ...) in a JAX
#:           program, against plain JAX of the same semantics.
PATHS = ("routed", "fused", "dropin", "compiled", "traced")

#: The operators a bridge decides for (RoIAlign has no framework code of its own in PyTorch).
OPS = ("upsample_bilinear2d", "avg_pool2d", "replication_pad2d", "group_norm_swish", "roi_align")

#: The default thresholds, in elements of the forward's input, per "bridge/path/op/threads":
#: fastbwd from this size on. From the sweep of `python3 -m bench --full` on 2-core AMD EPYC
#: VMs (docs/history.md, "Never slower: the thresholds"), float32 NCHW; other dtypes and the
#: channels-last layout use the same ones (PyTorch's half-precision and float64 kernels are
#: slower per element than its float32 ones, so fastbwd's crossover there is not later).
DEFAULTS = {
    # eager routing of F.interpolate (bilinear x2), F.avg_pool2d (k3 s2 p1), F.pad (replicate)
    "torch/routed/upsample_bilinear2d/1": 16384,
    "torch/routed/upsample_bilinear2d/2": 32768,
    "torch/routed/avg_pool2d/1": 65536,
    "torch/routed/avg_pool2d/2": 131072,
    "torch/routed/replication_pad2d/1": 131072,
    "torch/routed/replication_pad2d/2": 262144,
    # GroupNorm -> SiLU fused by fuse_group_norm_swish, and the GroupNormSwish drop-ins
    "torch/fused/group_norm_swish/1": 262144,
    "torch/fused/group_norm_swish/2": 524288,
    "torch/dropin/group_norm_swish/1": 131072,
    "torch/dropin/group_norm_swish/2": 262144,
    # torch.compile: fastbwd's graph nodes against Inductor's own code (which fuses GroupNorm
    # and SiLU into its own loops: its pairs win up to about a million elements)
    "torch/compiled/upsample_bilinear2d/1": 16384,
    "torch/compiled/upsample_bilinear2d/2": 16384,
    "torch/compiled/avg_pool2d/1": 131072,
    "torch/compiled/avg_pool2d/2": 262144,
    "torch/compiled/replication_pad2d/1": 131072,
    "torch/compiled/replication_pad2d/2": 262144,
    "torch/compiled/group_norm_swish/1": 2097152,
    "torch/compiled/group_norm_swish/2": 2097152,
    # fastbwd.jax's PyTorch-shaped functions (NCHW) against plain JAX of the same semantics; the
    # thread count is Numba's pool per device (fastbwd/jax/_decide.py)
    "jax/traced/upsample_bilinear2d/1": 65536,
    "jax/traced/upsample_bilinear2d/2": 32768,
    "jax/traced/avg_pool2d/1": 32768,
    "jax/traced/avg_pool2d/2": 65536,
    "jax/traced/replication_pad2d/1": 524288,
    "jax/traced/replication_pad2d/2": 2097152,
    "jax/traced/group_norm_swish/1": 1048576,
    "jax/traced/group_norm_swish/2": 1048576,
    "jax/traced/roi_align/1": 131072,
    "jax/traced/roi_align/2": 131072,
    # fastbwd.jax's drop-ins and reach (NHWC) against jax.image.resize, flax's avg_pool, jnp.pad,
    # the libraries' GroupNorm + swish
    "jax/dropin/upsample_bilinear2d/1": 32768,
    "jax/dropin/upsample_bilinear2d/2": 32768,
    "jax/dropin/avg_pool2d/1": 32768,
    "jax/dropin/avg_pool2d/2": 131072,
    "jax/dropin/replication_pad2d/1": 131072,
    "jax/dropin/replication_pad2d/2": 262144,
    "jax/dropin/group_norm_swish/1": 2097152,
    "jax/dropin/group_norm_swish/2": 2097152,
}

_lock = threading.Lock()
_stored = None  # the stored table's thresholds, once read ({} when there is none or it is ignored)
_status = None  # what reading the stored table found (status())
_cache = {}  # (bridge, path, op, threads, dtype, layout) -> threshold: a few dozen entries at most
#: (bridge, path, op) -> {thread count: floor()}: a bridge may hold one of these dicts (which stay
#: the same objects, emptied when the table is read again) and read it directly with the thread
#: count it runs on (a missing key: call floor()).
floors = {}
#: Counts the readings of the stored table (forget()): a bridge that keeps decisions keys them by it.
generation = 0


def default_policy():
    """The policy a bridge starts with: ``FASTBWD_POLICY`` (``auto`` or ``always``, read at
    import), else ``"auto"``."""
    return _config.POLICY


def check_policy(policy):
    """``policy`` when it is one of :data:`POLICIES`; else a ValueError saying which there are."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(map(repr, POLICIES))}, not {policy!r}")
    return policy


def thread_class(threads):
    """The thread count the thresholds are kept for: 1, or 2 for 2 and more."""
    return 1 if threads <= 1 else 2


def key(bridge, path, op, threads):
    """The table key of a threshold: ``"bridge/path/op/threads"``."""
    return f"{bridge}/{path}/{op}/{thread_class(threads)}"


def threshold(bridge, path, op, dtype="float32", layout="NCHW", threads=1):
    """The size (input elements) from which fastbwd's path is the faster one for these calls:
    the stored table's where it has one for this machine, else :data:`DEFAULTS`'; 0 (fastbwd
    always) for a key neither knows (a path that has not been measured keeps fastbwd, as
    before). The same for every call of these arguments in this process."""
    memo = (bridge, path, op, thread_class(threads), dtype, layout)
    found = _cache.get(memo)
    if found is None:
        name = key(bridge, path, op, threads)
        table = stored()
        # a key refined by dtype and layout ("torch/routed/avg_pool2d/2/bfloat16/NHWC") wins
        for candidate in (f"{name}/{dtype}/{layout}", f"{name}/{dtype}", name):
            if candidate in table:
                found = table[candidate]
                break
            if candidate in DEFAULTS:
                found = DEFAULTS[candidate]
                break
        else:
            found = 0
        _cache[memo] = found
    return found


def decide(policy, bridge, path, op, elements, dtype="float32", layout="NCHW", threads=1, tasks=None):
    """True when the call should run on fastbwd (whose kernels must still accept it), False
    when the framework's own code should: under ``"always"`` True; under ``"auto"`` whether
    ``elements`` reaches :func:`threshold`, and never when fastbwd's kernels split the call
    into fewer ``tasks`` than ``threads`` (None: enough), so that threads the framework's code
    would use stay idle (a channels-last GroupNorm+Swish of one image: docs/history.md)."""
    if policy == "always":
        return True
    if tasks is not None and tasks < threads:
        return False
    return elements >= threshold(bridge, path, op, dtype, layout, threads)


def floor(bridge, path, op, threads):
    """The smallest threshold of ``op`` on ``path`` for ``threads`` threads over every dtype and
    layout the tables hold: a call with fewer elements runs the framework's code under
    ``"auto"``, whatever else it is (a bridge may test this first, with one comparison). Kept in
    :func:`floors_of`'s dict under ``threads``."""
    memo = floors_of(bridge, path, op)
    found = memo.get(threads)
    if found is None:
        name = key(bridge, path, op, threads)
        table = stored()
        entries = {**DEFAULTS, **table}.items()
        values = [value for entry, value in entries if entry == name or entry.startswith(f"{name}/")]
        found = memo[threads] = min(values) if values else 0
    return found


def floors_of(bridge, path, op):
    """The dict of :func:`floor`'s values of ``op`` on ``path`` by thread count: the same object
    for the life of the process (a bridge may keep it), emptied whenever the table is read again."""
    found = floors.get((bridge, path, op))
    if found is None:
        found = floors.setdefault((bridge, path, op), {})
    return found


def _forget_floors():
    for found in floors.values():
        found.clear()


# ---- the stored table (python -m fastbwd --calibrate) -------------------------------------------

#: The sizes a calibration measures, (N, C, H, W): 512 to a million elements, about x2 apart.
LADDER = [(2, 16, size, size) for size in (4, 6, 8, 11, 16, 23, 32, 45, 64, 91, 128, 181)]


def crossover(points):
    """The threshold from ``[(elements, ratio)]`` (ascending sizes; ratio: the framework's time
    over fastbwd's path's): the smallest size from which every ratio is at least 1, each ratio
    taken as the median of itself and its neighbours (one round disturbed by another process
    moves no threshold); past the largest size (twice it) when the last one is below 1."""
    values = [value for _, value in points]
    smooth = [statistics.median(values[max(0, i - 1) : i + 2]) for i in range(len(values))]
    threshold = 2 * points[-1][0]
    for (elements, _), value in zip(reversed(points), reversed(smooth)):
        if value < 1.0:
            break
        threshold = elements
    return threshold


def alternating_ratio(steps, contexts=(None, None), seconds=1.0, rounds=7):
    """The framework's time over fastbwd's path's, as a calibration measures it: ``steps`` is
    ``(fastbwd's step, the framework's)``, zero-argument callables, each run inside its
    ``contexts`` entry (a context manager factory, or None), entered around a batch of calls and
    not timed. Each step runs once first (warming, compiling), then fastbwd's once more timed, to
    size the rounds; returns the median of ``rounds`` alternating rounds' ratios, each round
    timing about ``seconds / rounds / 2`` per side (a side's time: the median of its calls)."""
    sides = [(step, context or contextlib.nullcontext) for step, context in zip(steps, contexts)]
    for step, context in sides:
        with context():
            step()
    (step, context), _ = sides
    with context():
        start = time.perf_counter()
        step()
        each = time.perf_counter() - start
    calls = max(1, min(200, int(seconds / rounds / 2 / max(each, 1e-6))))
    ratios = []
    for _ in range(rounds):
        times = []
        for step, context in sides:
            with context():
                these = []
                for _ in range(calls):
                    start = time.perf_counter()
                    step()
                    these.append(time.perf_counter() - start)
            times.append(statistics.median(these))
        ratios.append(times[1] / times[0])
    return statistics.median(ratios)


#: The stored table's format; a table of another format is ignored.
FORMAT = 1
_FILE = "fastbwd-dispatch.json"


def table_path():
    """Where the stored table lives: beside Numba's cache of fastbwd's kernels
    (``NUMBA_CACHE_DIR`` when set, else the package's ``__pycache__`` folder)."""
    folder = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "__pycache__"
    )
    return os.path.join(folder, _FILE)


def machine():
    """What a stored table was measured on; a table measured on anything else is stale."""
    return {"fastbwd": __version__, "cpu": cpu_name(), "cpus": os.cpu_count()}


def cpu_name():
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def stored():
    """The stored table's thresholds that apply here (``{}`` when none does): read once."""
    global _stored, _status
    if _stored is None:
        with _lock:
            if _stored is None:
                _status, table = _read(table_path())
                _stored = table
    return _stored


def status():
    """What reading the stored table found: ``"none"`` (no file), ``"used: <path>"``, or
    ``"ignored: <why>"`` (unreadable, malformed, stale)."""
    stored()
    return _status


def forget():
    """Read the stored table again at the next decision (after a calibration; for tests)."""
    global _stored, _status, generation
    with _lock:
        _stored, _status = None, None
        _cache.clear()
        _forget_floors()
        generation += 1


@contextlib.contextmanager
def using(thresholds):
    """Decide with ``thresholds`` (``{"bridge/path/op/threads": elements}``, over the defaults) in
    place of the stored table, for the block: a calibration measuring fastbwd's path at a size
    the defaults give to the framework (threshold 0), and tests. Not for use while other threads
    decide."""
    global _stored, _status, generation
    with _lock:
        saved = _stored, _status
        _stored, _status = dict(thresholds), "set by _dispatch.using()"
        _cache.clear()
        _forget_floors()
        generation += 1
    try:
        yield
    finally:
        with _lock:
            _stored, _status = saved
            _cache.clear()
            _forget_floors()
            generation += 1


def _read(path):
    """``(status, thresholds)`` of the table at ``path``: thresholds ``{}`` unless it is well
    formed and was made on this machine with this fastbwd (entries of a bridge whose framework
    version differs are left out)."""
    try:  # bytes: text that is not UTF-8 is a JSON error below, not a failed call
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return "none", {}
    except OSError as error:
        return f"ignored: {path} cannot be read ({error})", {}
    try:
        table = json.loads(data)
    except ValueError as error:
        return f"ignored: {path} is not JSON ({error})", {}
    problem = _malformed(table)
    if problem:
        return f"ignored: {path} {problem}", {}
    if table["format"] != FORMAT:
        return f"ignored: {path} has format {table['format']}, this fastbwd reads {FORMAT}", {}
    here = machine()
    for name, value in here.items():
        if table["machine"].get(name) != value:
            return f"ignored: {path} was measured with {name} {table['machine'].get(name)!r}, not {value!r}", {}
    versions = table["frameworks"]
    thresholds = {
        name: value
        for name, value in table["thresholds"].items()
        if versions.get(name.split("/", 1)[0]) == framework_version(name.split("/", 1)[0])
    }
    return f"used: {path}", thresholds


def _malformed(table):
    """What is wrong with a parsed table's shape, or None."""
    if not isinstance(table, dict) or not {"format", "machine", "frameworks", "thresholds"} <= set(table):
        return "lacks format, machine, frameworks or thresholds"
    if not (isinstance(table["machine"], dict) and isinstance(table["frameworks"], dict)):
        return "has a machine or frameworks that is not an object"
    thresholds = table["thresholds"]
    if not isinstance(thresholds, dict):
        return "has thresholds that are not an object"
    for name, value in thresholds.items():
        parts = name.split("/")
        if len(parts) < 4 or parts[0] not in ("torch", "jax") or parts[1] not in PATHS or parts[2] not in OPS:
            return f"has an unknown threshold {name!r}"
        if type(value) is not int or value < 0:
            return f"has threshold {name!r} = {value!r}, not a size"
    return None


def framework_version(bridge):
    """The installed version of the bridge's framework (None when not installed), read without
    importing it: a stored threshold holds only for the version it was measured with."""
    from importlib import metadata

    try:
        return metadata.version({"torch": "torch", "jax": "jax"}[bridge])
    except metadata.PackageNotFoundError:
        return None


def store(thresholds):
    """Write ``thresholds`` (``{"bridge/path/op/threads": elements}``) as this machine's table,
    over the entries already stored for other keys, and decide with it from now on. The
    installed version of each bridge's framework is recorded: a table of another version is
    stale. Returns the path; raises OSError when the folder cannot be written (only a
    calibration writes: a call never does)."""
    path = table_path()
    _, kept = _read(path)
    merged = {**kept, **thresholds}
    versions = {bridge: framework_version(bridge) for bridge in {name.split("/", 1)[0] for name in merged}}
    table = {"format": FORMAT, "machine": machine(), "frameworks": versions, "thresholds": dict(sorted(merged.items()))}
    problem = _malformed(table)
    if problem:
        raise ValueError(f"not a dispatch table: it {problem}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as handle:
        json.dump(table, handle, indent=1)
        handle.write("\n")
    os.replace(temporary, path)  # readers see the old table or the new one, never half of one
    forget()
    return path
