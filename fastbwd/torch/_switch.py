"""The switch (docs/semantics.md §7, docs/torch.md "One switch per process"): whether fastbwd
serves PyTorch's calls, and the policy that says which (``fastbwd._dispatch``: "auto", fastbwd
where it is the faster; "always", wherever it can).

One switch for the whole process, on while ``enable()`` is in effect or while any
``with enabled():`` block runs, in any thread: a block ending never turns fastbwd off under
another block still running (each block is counted, not the state it found restored).

A leaf of the bridge: the parts that follow the switch read :func:`is_enabled` and
:func:`policy`, and hand :func:`follow` what turning it on (or changing the policy while it is on)
puts in place and turning it off takes out (the aten kernels of ``_routing`` under "always", the
functions of ``_functional`` under "auto", the compiler hooks of ``_compile``), so nothing here
imports them.
"""

import collections
import contextlib
import os
import threading
import warnings
from collections.abc import Iterator

from fastbwd import _dispatch

from . import _private

_lock = threading.Lock()
_explicit = False  # enable() was called since the last disable()
_blocks = collections.Counter()  # thread ident -> enabled() blocks that thread entered and has not left
_active = False  # _explicit or a block is running: what the routed kernels read
_policy = _dispatch.default_policy()  # FASTBWD_POLICY, else "auto"; set_policy() changes it
_parts = []  # (on, off) of each part that follows the switch, in the order they came
_graphs_when_disabled = 0  # how many graphs torch.compile had made when the switch last turned off
_noticed = False  # enable() has said that frames compiled while disabled keep PyTorch's code


def follow(on, off=None):
    """Run ``on()`` whenever the switch is on after ``enable()`` or a block's start, and ``off()``
    whenever it is off after ``disable()`` or a block's end (both under the switch's lock; they
    must be idempotent)."""
    _parts.append((on, off))


def enable(policy: str | None = None) -> None:
    """Run the backward of bilinear upsampling, avg-pool and replicate padding on fastbwd
    wherever fastbwd is the faster (the policy ``"auto"``, the default) or wherever it can
    (``"always"``: PyTorch's CPU ``upsample_bilinear2d_backward``, ``avg_pool2d_backward`` and
    ``replication_pad2d_backward``, and their ``.grad_input`` overloads, served by fastbwd), and
    compile fastbwd into the graphs ``torch.compile`` captures from now on, until :func:`disable`.

    Idempotent and thread-safe; for the whole process (every thread, and PyTorch's own). Model
    code does not change: the backward of ``F.interpolate(mode="bilinear")``, ``nn.Upsample``,
    ``F.avg_pool2d``, ``nn.AvgPool2d``, ``F.pad(mode="replicate")`` and ``nn.ReplicationPad2d``
    runs on fastbwd. ``policy`` (when given) is :func:`set_policy`'s, for the whole process;
    None keeps the current one (``FASTBWD_POLICY``, else ``"auto"``, until :func:`set_policy`).
    """
    global _explicit, _policy
    with _lock:
        if policy is not None:
            _policy = _dispatch.check_policy(policy)
        _explicit = True
        _update()


def disable() -> None:
    """End :func:`enable`: PyTorch's own CPU kernels serve these operators again (the same bits as
    before), once no ``with enabled():`` block is running in any thread; a block still running
    keeps fastbwd on until it ends. Idempotent and thread-safe, also while other threads run the
    operators."""
    global _explicit
    with _lock:
        _explicit = False
        _update()


def is_enabled() -> bool:
    """True while fastbwd serves PyTorch's backward kernels: after :func:`enable` (until
    :func:`disable`), or while a ``with enabled():`` block runs in any thread of the process."""
    return _active


def policy() -> str:
    """Where the bridge sends the calls it can serve: ``"auto"`` (to fastbwd where fastbwd's
    whole path is the faster, decided per call before any kernel runs: docs/semantics.md §7) or
    ``"always"`` (every call fastbwd can serve, as before issue 52)."""
    return _policy


def set_policy(policy: str) -> None:
    """Set the policy (``"auto"`` or ``"always"``) for the whole process, as the switch is;
    ``FASTBWD_POLICY`` sets the one a process starts with. Calls already decided keep their
    decision: a graph compiled under one policy until it is compiled again."""
    global _policy
    with _lock:
        _policy = _dispatch.check_policy(policy)
        if _active:  # the parts put in place what this policy needs
            _update()


@contextlib.contextmanager
def enabled(policy: str | None = None) -> Iterator[None]:
    """``with fastbwd.torch.enabled(): ...``: fastbwd serves PyTorch's calls, in the whole process,
    at least until the block ends. Blocks nest, in one thread or across threads: fastbwd stays on
    while any block runs, and after the last one ends it is what :func:`enable` and
    :func:`disable` last said (off if neither was called). With ``policy``, that policy for the
    block (for the whole process, as :func:`set_policy`), the one it found put back at its end."""
    global _policy
    owner = threading.get_ident()  # the block's thread, even if a generator ends it elsewhere
    with _lock:
        previous = _policy
        if policy is not None:
            _policy = _dispatch.check_policy(policy)
        _blocks[owner] += 1
        _update()
    try:
        yield
    finally:
        with _lock:
            _blocks[owner] -= 1
            if not _blocks[owner]:
                del _blocks[owner]
            if policy is not None:
                _policy = previous
            _update()


def _update():
    """Put the parts in the state the switch is now in (under the lock)."""
    global _active, _graphs_when_disabled
    on = _explicit or bool(_blocks)
    if on:
        for turn_on, _ in _parts:
            turn_on()
        if not _active:
            _notice_frames_compiled_while_disabled()
    else:
        if _active:
            _graphs_when_disabled = (_private.compiled_graphs() or (0, False))[0]
        for _, turn_off in _parts:
            if turn_off is not None:
                turn_off()
    _active = on


def _after_fork_in_child():
    """A forked process has only the thread that forked: the blocks of the others never end
    there, so they no longer count; and a lock another thread held at the fork is free. (The
    parts catch up at the child's next enable(), disable() or block: nothing that may wait for
    another lock runs here.)"""
    global _lock, _active
    _lock = threading.Lock()
    mine = _blocks.get(threading.get_ident(), 0)
    _blocks.clear()
    if mine:
        _blocks[threading.get_ident()] = mine
    _active = _explicit or bool(_blocks)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _notice_frames_compiled_while_disabled():
    """Dynamo does not guard on the switch: a frame compiled while fastbwd was disabled keeps
    PyTorch's code after enable(), and so does every later model of the same class, which
    reuses it. Say so, once per process, when there are such frames."""
    global _noticed
    compiled = _private.compiled_graphs()
    if _noticed or compiled is None:
        return
    graphs, alive = compiled
    # Every graph made since the switch last turned off was made while disabled; if Dynamo still
    # holds any frame, one of those is among them (a reset since would have dropped the older ones too).
    if alive and graphs > _graphs_when_disabled:
        _noticed = True
        warnings.warn(
            "fastbwd.torch.enable(): torch.compile compiled frames while fastbwd was disabled. Dynamo does "
            "not guard on fastbwd's switch, so those frames keep PyTorch's own code "
            "(and a new model of the same class reuses it): their bilinear upsampling, avg-pool, replicate pad "
            "and GroupNorm + SiLU do not run on fastbwd. Call torch.compiler.reset() after enable() to compile "
            "them again with fastbwd, or enable fastbwd before the first compiled call. (Said once per process.)",
            UserWarning,
            stacklevel=4,
        )
