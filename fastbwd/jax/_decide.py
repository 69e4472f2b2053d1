"""Where a fastbwd.jax call runs: fastbwd's kernels or JAX's own code, decided at trace time
(docs/design.md, "Never slower"; docs/semantics.md §8).

Every function of the bridge that would emit a fastbwd FFI call asks :func:`serves` first, once
its arguments are validated (so a call refused by fastbwd's checks raises the same error under
either policy). The answer is fastbwd's one decision (``fastbwd._dispatch.decide``, bridge
``"jax"``) for the call's static description:

* the path: ``"traced"`` for the PyTorch-shaped functions (``fastbwd.jax.upsample_bilinear2d``,
  ...), whose alternative is plain JAX code of the same semantics; ``"dropin"`` for the drop-ins
  and everything ``reach`` serves, whose alternative is the library's own function;
* the operator, the dtype and the layout;
* the elements of one call: the traced input's, times the sizes of the ``jax.vmap`` axes over it
  (one FFI call serves the whole batch), per device where the trace knows the program's split
  (inside ``shard_map``: the local shapes; a mesh of explicit axes: the input's shard);
* the thread count: the Numba threads the handler runs the kernels on, Numba's pool size
  (``NUMBA_NUM_THREADS``: XLA's threads, which run the handler, never change it; 1 when fastbwd
  runs serially), divided among the devices of the process that run the program at once, as the
  handler divides them (``_ffi._on_its_share``).

The policy is a JAX user context (``jax.make_user_context``): its value is part of the key of
JAX's trace and compile caches, so a ``jax.jit`` function traced under one policy is traced
again under the other, and each program keeps the decision it was traced with.
"""

import math
import threading

import jax
import numba
import numpy as np
from jax.sharding import AxisType

from .. import _dispatch
from ..api import group_norm_swish as gns_api
from ..kernels import _jit

BRIDGE = "jax"


class _Setting:
    """``jax.make_user_context``'s interface for a JAX without it: a process-wide value with a
    per-thread override, unknown to JAX's caches (a function traced under one policy keeps its
    program under the other)."""

    def __init__(self, value):
        self._global, self._local = value, threading.local()

    @property
    def value(self):
        return getattr(self._local, "value", self._global)

    def get_global(self):
        return self._global

    def set_global(self, value):
        self._global = value

    def __call__(self, value):
        setting = self

        class Entered:
            def __enter__(self):
                self.previous = getattr(setting._local, "value", None)
                setting._local.value = value

            def __exit__(self, *_):
                if self.previous is None:
                    del setting._local.value
                else:
                    setting._local.value = self.previous

        return Entered()


def _make_policy():
    make = getattr(jax, "make_user_context", None)
    start = _dispatch.default_policy()
    return _Setting(start) if make is None else make(start)


#: The policy fastbwd.jax decides with (a JAX user context; FASTBWD_POLICY, else "auto", to start).
_POLICY = _make_policy()


def policy() -> str:
    """Where fastbwd.jax sends the calls it can serve, in the calling thread: ``"auto"`` (to
    fastbwd's kernels where their whole path is the faster, decided when JAX traces the call from
    its shapes; smaller calls trace JAX's own code: docs/semantics.md §8) or ``"always"`` (every
    call fastbwd can serve, as before issue 52). ``FASTBWD_POLICY`` (else ``"auto"``) until
    :func:`set_policy` changes it; inside ``reach(policy=...)``, that one."""
    return _POLICY.value


def set_policy(policy: str) -> None:
    """Set the policy (``"auto"`` or ``"always"``) for the whole process; a thread inside
    ``reach(policy=...)`` keeps that one until it exits. The policy is part of JAX's trace and
    compile caches: a ``jax.jit`` function traced under one policy is traced again when called
    under the other, and each program keeps the decisions it was traced with. Raises ValueError
    for any other value."""
    _POLICY.set_global(_dispatch.check_policy(policy))


def policy_block(policy):
    """A context manager putting the calling thread under ``policy`` until it exits."""
    return _POLICY(_dispatch.check_policy(policy))


def threads(devices=1):
    """The Numba threads the handler runs a call on when ``devices`` devices of this process run
    the program at once: the pool's size divided among them (at least 1)."""
    total = 1 if _jit._serial_only else numba.config.NUMBA_NUM_THREADS
    return max(1, total // max(1, devices))


def _vmapped(x):
    """The product of the sizes of the ``jax.vmap`` axes over ``x`` (1 outside vmap): the FFI
    call of a vmapped function serves the whole batch. Read from JAX's tracers (a private
    interface: without it, the unbatched size, which is what the trace shows): a batching
    tracer's value has the vmapped axis, and a differentiating tracer's primal holds the
    tracers of the transformations outside it (``jax.vmap`` of ``jax.grad``)."""
    factor = 1
    try:
        from jax._src.interpreters.batching import BatchTracer
    except ImportError:  # pragma: no cover - a JAX that moved it: the example's own size
        return factor
    while True:
        if isinstance(x, BatchTracer):
            if isinstance(x.batch_dim, int):
                factor *= x.val.shape[x.batch_dim]
            x = x.val
        elif hasattr(x, "primal") and hasattr(x, "tangent"):  # jvp, linearize (grad)
            x = x.primal
        else:
            return factor


def placement(x):
    """``(elements, devices)`` of a call on ``x``: the elements one FFI call serves, and how many
    devices of this process run the program at once (sharing the cores)."""
    elements = math.prod(x.shape) * _vmapped(x)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and AxisType.Manual in mesh.axis_types:  # shard_map: x is a device's part
        return elements, min(mesh.size, jax.local_device_count())
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return elements, 1
    axes = zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
    explicit = {name: size for name, size, kind in axes if kind == AxisType.Explicit}
    shards = 1
    for entry in getattr(sharding, "spec", ()):
        for name in (entry,) if isinstance(entry, str) else entry or ():
            shards *= explicit.get(name, 1)
    if shards <= 1:
        return elements, 1
    return -(-elements // shards), min(math.prod(explicit.values()), jax.local_device_count())


def serves(path, op, x, layout, groups=None, batched=True):
    """True when the call of ``op`` on ``x`` (its forward input, in ``layout``) reached by
    ``path`` runs fastbwd's kernels: always under the policy ``"always"``; under ``"auto"``,
    where fastbwd's whole path is the faster one (``fastbwd._dispatch``). False: the caller
    traces JAX's own code instead (no FFI call). ``groups``: a GroupNorm+Swish call's, whose
    kernels' tasks the decision counts (``batched`` False: ``x`` is one image, as Equinox's,
    its batch from ``jax.vmap``)."""
    current = _POLICY.value
    if current == "always":
        return True
    elements, devices = placement(x)
    count = threads(devices)
    tasks = None
    if groups is not None:
        image = x.shape[1:] if batched else x.shape
        per_image = math.prod(image)
        if image and per_image:
            channels = image[0] if layout == "NCHW" else image[-1]
            tasks = gns_api.parallel_tasks(elements // per_image, channels, groups, layout, count)
    return _dispatch.decide(current, BRIDGE, path, op, elements, np.dtype(x.dtype).name, layout, count, tasks)
