"""The switch (docs/semantics.md §7): whether fastbwd serves PyTorch's calls.

A leaf of the bridge: the parts that follow the switch read :func:`is_enabled`, and hand
:func:`follow` what ``enable()`` puts in place and ``disable()`` takes out (the aten kernels of
``_routing``, the compiler hooks of ``_compile``), so nothing here imports them.
"""

import contextlib
import threading
import warnings
from collections.abc import Iterator

from . import _private

_lock = threading.Lock()
_active = False
_parts = []  # (on, off) of each part that follows the switch, in the order they came
_graphs_when_disabled = 0  # how many graphs torch.compile had made at the last disable()
_noticed = False  # enable() has said that frames compiled while disabled keep PyTorch's code


def follow(on, off=None):
    """Run ``on()`` at every ``enable()`` and ``off()`` at every ``disable()`` (both under the
    switch's lock; they must be idempotent)."""
    _parts.append((on, off))


def enable() -> None:
    """Serve PyTorch's CPU ``upsample_bilinear2d_backward``, ``avg_pool2d_backward`` and
    ``replication_pad2d_backward`` (and their ``.grad_input`` overloads) with fastbwd, and
    compile fastbwd into the graphs ``torch.compile`` captures from now on.

    Idempotent and thread-safe. Model code does not change: the backward of
    ``F.interpolate(mode="bilinear")``, ``nn.Upsample``, ``F.avg_pool2d``, ``nn.AvgPool2d``,
    ``F.pad(mode="replicate")`` and ``nn.ReplicationPad2d`` runs on fastbwd.
    """
    global _active
    with _lock:
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


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """``with fastbwd.torch.enabled(): ...`` enables the routing for the block, then restores
    the state it found (a block inside an enabled region leaves it enabled)."""
    was_enabled = _active
    enable()
    try:
        yield
    finally:
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
