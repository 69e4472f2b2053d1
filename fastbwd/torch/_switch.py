"""The switch (docs/semantics.md §7): whether fastbwd serves PyTorch's calls, and the policy
that says which (``fastbwd._dispatch``: "auto", fastbwd where it is the faster; "always").

A leaf of the bridge: the parts that follow the switch read :func:`is_enabled` and
:func:`policy`, and hand :func:`follow` what ``enable()`` puts in place and ``disable()`` takes
out (the aten kernels of ``_routing``, the functions of ``_functional``, the compiler hooks of
``_compile``), so nothing here imports them.
"""

import contextlib
import threading
import warnings
from collections.abc import Iterator

from fastbwd import _dispatch

from . import _private

_lock = threading.Lock()
_active = False
_policy = _dispatch.default_policy()  # FASTBWD_POLICY, else "auto"
_parts = []  # (on, off) of each part that follows the switch, in the order they came
_graphs_when_disabled = 0  # how many graphs torch.compile had made at the last disable()
_noticed = False  # enable() has said that frames compiled while disabled keep PyTorch's code


def follow(on, off=None):
    """Run ``on()`` at every ``enable()`` and ``off()`` at every ``disable()`` (both under the
    switch's lock; they must be idempotent)."""
    _parts.append((on, off))


def enable(policy: str | None = None) -> None:
    """Run the backward of bilinear upsampling, avg-pool and replicate padding on fastbwd
    wherever fastbwd is the faster (``policy="auto"``, the default) or wherever it can
    (``"always"``), and compile fastbwd into the graphs ``torch.compile`` captures from now on.

    Idempotent and thread-safe. Model code does not change: the backward of
    ``F.interpolate(mode="bilinear")``, ``nn.Upsample``, ``F.avg_pool2d``, ``nn.AvgPool2d``,
    ``F.pad(mode="replicate")`` and ``nn.ReplicationPad2d`` runs on fastbwd. ``policy`` (when
    given) is :func:`set_policy`'s, for the whole process; None keeps the current one
    (``FASTBWD_POLICY``, else ``"auto"``, until :func:`set_policy` changes it).
    """
    global _active, _policy
    with _lock:
        if policy is not None:
            _policy = _dispatch.check_policy(policy)
        for on, _ in _parts:
            on()
        if not _active:
            _notice_frames_compiled_while_disabled()
        _active = True


def disable() -> None:
    """Give these operators back to PyTorch's own CPU kernels (the same bits as before
    :func:`enable`). Idempotent and thread-safe, also while other threads run the operators."""
    global _active, _graphs_when_disabled
    with _lock:
        if _active:
            _graphs_when_disabled = (_private.compiled_graphs() or (0, False))[0]
        _active = False
        for _, off in _parts:
            if off is not None:
                off()


def is_enabled() -> bool:
    """True while fastbwd serves PyTorch's backward kernels."""
    return _active


def policy() -> str:
    """Where the bridge sends the calls it can serve: ``"auto"`` (to fastbwd where fastbwd's
    whole path is the faster, decided per call before any kernel runs: docs/semantics.md §7) or
    ``"always"`` (every call fastbwd can serve, as before issue 52)."""
    return _policy


def set_policy(policy: str) -> None:
    """Set the policy (``"auto"`` or ``"always"``) for the whole process, as ``enable()`` is;
    ``FASTBWD_POLICY`` sets the one a process starts with. Calls already decided keep their
    decision: a graph compiled under one policy until it is compiled again."""
    global _policy
    with _lock:
        _policy = _dispatch.check_policy(policy)
        if _active:  # the parts put in place what this policy needs
            for on, _ in _parts:
                on()


@contextlib.contextmanager
def enabled(policy: str | None = None) -> Iterator[None]:
    """``with fastbwd.torch.enabled(): ...`` enables the routing for the block, then restores
    the state it found (a block inside an enabled region leaves it enabled); with ``policy``,
    that policy for the block, the previous one restored after it."""
    was_enabled, previous = _active, _policy
    if policy is not None:
        _dispatch.check_policy(policy)
    enable(policy)
    try:
        yield
    finally:
        if policy is not None and policy != previous:
            set_policy(previous)
        if not was_enabled:
            disable()


def _notice_frames_compiled_while_disabled():
    """Dynamo does not guard on the switch: a frame compiled while fastbwd was disabled keeps
    PyTorch's code after enable(), and so does every later model of the same class, which
    reuses it. Say so, once per process, when there are such frames."""
    global _noticed
    compiled = _private.compiled_graphs()
    if _noticed or compiled is None:
        return
    graphs, alive = compiled
    # Every graph made since the last disable() was made while disabled; if Dynamo still holds
    # any frame, one of those is among them (a reset since would have dropped the older ones too).
    if alive and graphs > _graphs_when_disabled:
        _noticed = True
        warnings.warn(
            "fastbwd.torch.enable(): torch.compile compiled frames while fastbwd was disabled. Dynamo does "
            "not guard on fastbwd's switch, so those frames keep PyTorch's own code "
            "(and a new model of the same class reuses it): their bilinear upsampling, avg-pool, replicate pad "
            "and GroupNorm + SiLU do not run on fastbwd. Call torch.compiler.reset() after enable() to compile "
            "them again with fastbwd, or enable fastbwd before the first compiled call. (Said once per process.)",
            UserWarning,
            stacklevel=3,
        )
