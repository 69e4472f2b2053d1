"""fastbwd.jax.reach: models written for Flax (linen, NNX) and Equinox reach fastbwd's kernels
without a change to their code, and without a change to the models (docs/jax.md).

``reach`` is a context of the calling thread (fastbwd/jax/_seams.py): a program traced inside it,
in this thread, reaches fastbwd; a program traced outside it, in any thread, is the libraries'
own. Inside it:

* the library functions fastbwd serves run fastbwd's drop-ins, through the wrappers _seams
  installs once: ``jax.image.resize``, ``jnp.pad`` and the swish/SiLU functions (registered
  here), Flax's ``avg_pool`` and the NNX and Equinox modules' calls (registered by
  fastbwd.jax.linen, .nnx and .equinox);
* a Flax linen ``nn.GroupNorm`` runs on fastbwd (``nn.intercept_methods``, entered by the
  thread's outermost reach);
* a swish applied to the output of a GroupNorm fastbwd computed becomes one fused GroupNorm +
  Swish (the GroupNorm's own result, then unused, is dropped by XLA).

The libraries' adapters (linen.py, nnx.py, equinox.py) register with this module (their seams
with _seams, an :class:`Adapter` here) when they are imported; this module never imports them:
fastbwd.jax gives it the function that imports those of the libraries already imported
(``ADAPTER_IMPORTS``).
"""

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable

import jax

from .. import _dispatch
from . import _decide, _pad, _seams, _upsample
from . import _group_norm_swish as gns

# ---- a swish of a GroupNorm's output: the fused pair --------------------------------------------

_pairs = threading.local()  # .table: {id(output): (weakref to output, fused)}


def remember_group_norm(output, fused):
    """``output``, a GroupNorm result fastbwd computed, with ``fused()``, the same GroupNorm
    followed by Swish as one call: :func:`swish` of ``output`` returns ``fused()``."""
    table = getattr(_pairs, "table", None)
    if table is None:
        table = _pairs.table = {}
    key = id(output)
    try:
        reference = weakref.ref(output, lambda _: table.pop(key, None))
    except TypeError:  # pragma: no cover - every JAX array and tracer takes weak references
        return output
    table[key] = (reference, fused)
    return output


def _fused(x):
    entry = getattr(_pairs, "table", {}).get(id(x))
    if entry is not None and entry[0]() is x:
        return entry[1]
    return None


silu = jax.nn.silu  # the original, whatever reach later installs as jax.nn.silu


def swish_or(fallback, *args, **kwargs):
    """The swish/SiLU drop-in: of the output of a GroupNorm fastbwd computed, the fused GroupNorm
    + Swish; any other call, ``fallback(*args, **kwargs)`` (``jax.nn.silu``)."""
    if len(args) == 1 and not kwargs:
        fused = _fused(args[0])
        if fused is not None:
            return fused()
    return fallback(*args, **kwargs)


@functools.wraps(silu)
def swish(x):
    """``jax.nn.silu`` (``swish``): ``x * sigmoid(x)``; of the output of a GroupNorm fastbwd
    computed, the fused GroupNorm + Swish (what a swish layer a model holds becomes in reach)."""
    return swish_or(silu, x)


def group_norm_served(x, layout, groups, batched=True):
    """Whether fastbwd serves a library's GroupNorm of ``x`` (the library's own input, in
    ``layout``, in ``groups`` groups; ``batched`` False: one image, Equinox's); False: the
    library's own call runs (the policy "auto", fastbwd/jax/_decide.py).
    An adapter asks before it promotes ``x`` or adds an axis, so that a call left to the library
    traces nothing of fastbwd's: the library's own jaxpr."""
    return _decide.serves("dropin", gns.FUNC, x, layout, groups, batched)


def group_norm(x, groups, eps, layout, result_dtype, shape, parameters, fallback, with_swish=False):
    """A library's GroupNorm (``with_swish``: followed by Swish) on fastbwd, or its own code.

    ``x``: the input as fastbwd's kernels take it (the library's promotions applied, a batch
    axis added where the library has none); ``shape``: the library's result shape;
    ``parameters(create)``: ``(weight, bias)``, ``create`` telling a Flax linen module to
    create them (``False``: they exist, ``fallback`` made them); ``fallback()``: the library's
    own call, for what fastbwd's kernels cannot serve (the adapter has asked
    :func:`group_norm_served` first). A GroupNorm alone is remembered with its fused pair, for
    :func:`swish`."""
    fused = gns.servable(x, groups, eps, layout, True)

    def run(weight_and_bias, activate_swish):
        out = gns.library_call(x, *weight_and_bias, groups, eps, layout, activate_swish, result_dtype)
        return out.reshape(shape)

    if with_swish:
        return run(parameters(True), True) if fused else swish(fallback())
    out = run(parameters(True), False) if gns.servable(x, groups, eps, layout, False) else fallback()
    if fused:
        weight_and_bias = parameters(False)
        remember_group_norm(out, lambda: run(weight_and_bias, True))
    return out


# ---- what reach serves, and the adapters of the libraries ---------------------------------------

_seams.register("jax.image", ("resize",), _upsample._jax_resize, _upsample.resize_or)
_seams.register("jax.numpy", ("pad",), _pad._jnp_pad, _pad.pad_or)
_seams.register("jax.nn", ("silu", "swish"), silu, swish_or)


@dataclasses.dataclass(frozen=True)
class Adapter:
    """What a library's adapter brings to reach besides its seams: ``enter()``, a context manager
    entered by a thread's outermost reach (Flax linen's interceptor), or None; and
    ``is_model(target)``, true for the library's models, which reach refuses (it reaches the
    function that calls a model, and never changes the model)."""

    library: str
    enter: Callable | None = None
    is_model: Callable = lambda target: False


_adapters: dict[str, Adapter] = {}
_adapters_lock = threading.Lock()

#: Functions importing the adapters of the libraries already imported (fastbwd.jax sets one):
#: run by each outermost reach, before the install.
ADAPTER_IMPORTS: list[Callable[[], None]] = []


def register_adapter(adapter):
    """Called by a library's adapter when it is imported."""
    with _adapters_lock:
        _adapters[adapter.library] = adapter


def _import_adapters():
    for importer in ADAPTER_IMPORTS:
        importer()
    with _adapters_lock:
        return list(_adapters.values())


@contextlib.contextmanager
def _reaching(policy=None):
    if _seams.active():
        # a reach inside reach: the outer one holds everything, nothing is entered twice
        with contextlib.nullcontext() if policy is None else _decide.policy_block(policy):
            yield
        return
    adapters = _import_adapters()
    _seams.install()
    with contextlib.ExitStack() as stack:
        if policy is not None:
            stack.enter_context(_decide.policy_block(policy))
        stack.enter_context(_seams.entered())
        for adapter in adapters:
            if adapter.enter is not None:
                stack.enter_context(adapter.enter())
        yield


def reach(target=None, *, policy=None):
    """Run Flax and Equinox models' GroupNorm, pooling, padding and resizing on fastbwd.

    * ``with fastbwd.jax.reach(): ...``: programs traced inside, in this thread (``jax.jit``,
      ``jax.grad``, eager calls), reach fastbwd. The context is part of JAX's trace cache key: a
      ``jax.jit`` function traced before is traced again inside, and a program traced inside is
      not reused outside.
    * ``fastbwd.jax.reach(function)``: a new function, ``function`` (a loss, a training step, a
      linen ``model.apply``) called under ``reach()``, so whenever JAX traces it.

    One way for Flax linen, Flax NNX and Equinox alike: the model is never changed (its class,
    its modules and its pytree structure stay the user's), and a model itself is refused
    (``TypeError``: give ``reach`` the function that calls it). Everything reached computes what
    the library computes (docs/jax.md says where it differs within float tolerance); a call
    fastbwd cannot serve runs the library's own code, and so does a call where the library's
    code is the faster (the policy ``"auto"``, decided when JAX traces the call). Code traced
    outside reach, in any thread, runs the libraries' own functions and programs, bit for bit;
    what reach installs in the libraries to make this possible is listed in docs/jax.md.

    ``policy`` (``"auto"`` or ``"always"``; None: :func:`fastbwd.jax.policy`'s) is the policy of
    everything the thread traces inside, the PyTorch-shaped functions too; like the context, it
    is part of JAX's cache key.
    """
    if policy is not None:
        _dispatch.check_policy(policy)
    if target is None:
        return _reaching(policy)
    for adapter in _import_adapters():
        if adapter.is_model(target):
            raise TypeError(
                f"fastbwd.jax.reach: got a {adapter.library} model ({type(target).__name__}); give it the "
                "function that calls the model (fastbwd.jax.reach(loss), fastbwd.jax.reach(model.apply) for "
                "Flax linen), or trace that under `with fastbwd.jax.reach():` (reach never changes a model)"
            )
    if not callable(target):
        raise TypeError(f"fastbwd.jax.reach: expected a function, got {target!r}")

    @functools.wraps(target)
    def reached(*args, **kwargs):
        with _reaching(policy):
            return target(*args, **kwargs)

    return reached
