"""What fastbwd.jax.reach installs in the libraries, and the one place it decides, call by call,
whose code runs: fastbwd's drop-in or the library's own function (docs/jax.md, "What reach
installs").

``reach`` is a context of the calling thread, held in a JAX user context
(``jax.make_user_context``): thread-local, and part of the key of JAX's trace and compile
caches, so a function traced outside reach is traced again inside it, and a program traced
inside is never reused outside.

Each library function reach serves (``jnp.pad``, ``jax.image.resize``, the swish/SiLU functions,
Flax's ``avg_pool``, the NNX and Equinox modules' ``__call__``) is registered here as a
:class:`Seam` by the module that serves it. :func:`install` replaces each such attribute, once
and for the rest of the process, by a thin wrapper of the original: outside reach it calls the
original with the same arguments (the same result, bit for bit, and the same traced program);
inside reach, :func:`route` gives the call to the drop-in, which itself runs the original for a
call it cannot serve. Nothing is ever put back or installed twice, so a user's own later
assignment of the attribute stays.
"""

import dataclasses
import functools
import sys
import threading
from collections.abc import Callable

import jax


class _ThreadFlag:
    """``jax.make_user_context``'s interface for a JAX without it: per thread, but unknown to
    JAX's caches (a jitted function traced before reach keeps its program inside it)."""

    def __init__(self):
        self._local = threading.local()

    @property
    def value(self):
        return getattr(self._local, "value", False)

    def __call__(self, value):
        flag = self

        class Entered:
            def __enter__(self):
                self.previous, flag._local.value = flag.value, value

            def __exit__(self, *_):
                flag._local.value = self.previous

        return Entered()


def _make_state():
    make = getattr(jax, "make_user_context", None)
    return _ThreadFlag() if make is None else make(False)


#: True in a thread while it runs inside reach (a JAX user context: per thread, in jit's key).
_STATE = _make_state()


def active():
    """Whether the calling thread is inside reach."""
    return bool(_STATE.value)


def entered():
    """A context manager putting the calling thread inside reach until it exits."""
    return _STATE(True)


def route(original, drop_in, args, kwargs):
    """The one place reach decides whose code runs a call of a function it installed: inside
    reach (in this thread), fastbwd's ``drop_in(original, *args, **kwargs)``, which runs
    ``original`` for a call it cannot serve; outside, ``original(*args, **kwargs)``, untouched."""
    if _STATE.value:
        return drop_in(original, *args, **kwargs)
    return original(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Seam:
    """Where a library holds a function reach serves: the attributes ``names`` of ``owner`` (a
    module's name: installed once that module is imported; or a class), each holding
    ``original``; ``drop_in(original, *args, **kwargs)`` serves its calls inside reach."""

    owner: str | type
    names: tuple[str, ...]
    original: Callable
    drop_in: Callable


_lock = threading.Lock()
_seams: list[Seam] = []
_wrappers: dict[int, tuple[Callable, Callable]] = {}  # id(original): (original, its wrapper)
_installed: dict[tuple[int, str], object] = {}  # (id(owner), name): owner, for each attribute set

#: What a wrapper of a jitted function (``jax.nn.silu``) keeps of its methods.
_JIT_METHODS = ("lower", "trace", "eval_shape", "clear_cache")


def register(owner, names, original, drop_in):
    """Register a :class:`Seam` (installed by the next :func:`install`). One original has one
    drop-in and one wrapper, wherever it is held."""
    seam = Seam(owner, tuple(names), original, drop_in)
    with _lock:
        known = _wrappers.get(id(original))
        if known is None:
            _wrappers[id(original)] = (original, _wrap(seam))
        elif known[1].__fastbwd_drop_in__ is not drop_in:
            raise ValueError(f"fastbwd.jax: {original!r} registered with two drop-ins")
        if seam not in _seams:
            _seams.append(seam)


def _wrap(seam):
    """The function installed in place of ``seam.original``: the original outside reach."""
    original, drop_in = seam.original, seam.drop_in

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return route(original, drop_in, args, kwargs)

    for name in _JIT_METHODS:
        if callable(getattr(original, name, None)):
            setattr(wrapper, name, getattr(original, name))
    if isinstance(seam.owner, str):
        # pickled by reference to where it is installed (jax.image.resize's own __module__ is
        # private: pickle would find the original there, not the wrapper)
        wrapper.__module__, wrapper.__qualname__ = seam.owner, seam.names[0]
    wrapper.__fastbwd_drop_in__ = drop_in
    return wrapper


def wrapper_of(original):
    """The function reach installs in place of ``original`` (None when none is registered)."""
    known = _wrappers.get(id(original))
    return None if known is None else known[1]


def install():
    """Install every registered seam whose owner is loaded and not yet installed: once each,
    under a lock, all or nothing (a failure puts back what this call set, and raises). An
    attribute that no longer holds the original (the user set it) is left alone."""
    with _lock:
        pending = []
        for seam in _seams:
            owner = sys.modules.get(seam.owner) if isinstance(seam.owner, str) else seam.owner
            if owner is None:
                continue
            for name in seam.names:
                if (id(owner), name) not in _installed and vars(owner).get(name) is seam.original:
                    pending.append((owner, name, seam.original, _wrappers[id(seam.original)][1]))
        done = []
        try:
            for owner, name, original, wrapper in pending:
                setattr(owner, name, wrapper)
                done.append((owner, name, original, wrapper))
        except BaseException:
            for owner, name, original, wrapper in reversed(done):
                if vars(owner).get(name) is wrapper:
                    setattr(owner, name, original)
            raise
        for owner, name, _, _ in done:
            _installed[(id(owner), name)] = owner


def installed():
    """``[(owner, name)]`` of every attribute reach has set (for tests and docs)."""
    with _lock:
        return [(owner, name) for (_, name), owner in _installed.items()]


def _exclude_from_source_info():
    """JAX names the innermost frame outside its own files as an operation's source in the
    compiled program's metadata: without this, the wrappers' frames would replace the user's
    line there (the computation is the same either way)."""
    try:
        from jax._src import source_info_util

        source_info_util.register_exclusion(__file__)
    except (ImportError, AttributeError):  # a JAX without it: only the metadata's lines differ
        pass


_exclude_from_source_info()
