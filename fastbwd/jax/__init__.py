"""fastbwd.jax: JAX programs on CPU get fastbwd's backward kernels (docs/semantics.md §8).

Needs JAX: ``pip install jax`` (or ``pip install -e ".[jax]"`` in fastbwd's checkout). ``import fastbwd`` never imports jax; this module does.

Each function's forward is XLA's (``jax.numpy``/``lax``, fused with the rest of the program) or
fastbwd's kernel where XLA's is slow on the CPU (GroupNorm + Swish, RoIAlign, a stride-1 "SAME"
average pooling), and its gradient is the fastbwd backward, through XLA's FFI: the kernels read
and write XLA's buffers in place. They work under ``jax.jit``, ``jax.grad``/``jax.vjp``,
``jax.jvp`` (forward mode evaluates plain JAX) and ``jax.vmap``, in float32, float64 (with x64
enabled), bfloat16 and float16, on the CPU (docs/jax.md).

PyTorch-shaped, channels first or last (``layout="NHWC"``):

* :func:`upsample_bilinear2d`: ``F.interpolate(mode="bilinear")``;
* :func:`avg_pool2d`: ``F.avg_pool2d``;
* :func:`replication_pad2d`: ``F.pad(mode="replicate")``;
* :func:`roi_align`: ``torchvision.ops.roi_align``;
* :func:`group_norm_swish`: GroupNorm followed by Swish/SiLU, or alone.

Drop-ins with the signatures JAX users call (each runs the library's own code for a call it
cannot serve):

* :func:`resize`: ``jax.image.resize`` (linear);
* :func:`avg_pool`: ``flax.linen.avg_pool``;
* :func:`pad`: ``jnp.pad`` (``mode="edge"``);
* ``fastbwd.jax.linen.GroupNorm``, ``fastbwd.jax.nnx.GroupNorm``, ``fastbwd.jax.equinox.GroupNorm``:
  the libraries' GroupNorm modules, optionally fused with Swish.

:func:`reach`: Flax (linen, NNX) and Equinox models get all of these by one call around the
function that calls them, without a change to their code or to the models.
"""

import sys

try:
    import jax  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "fastbwd.jax needs JAX, which is not installed: pip install jax "
        '(or pip install -e ".[jax]" in fastbwd\'s checkout)'
    ) from error

from . import _reach
from ._avg_pool import avg_pool, avg_pool2d
from ._group_norm_swish import group_norm_swish
from ._pad import pad, replication_pad2d
from ._reach import reach
from ._roi_align import roi_align
from ._upsample import resize, upsample_bilinear2d


def _import_adapters():
    """Import fastbwd's adapter of each library reach serves that is already imported (each
    registers with reach on import; fastbwd.jax never imports Flax or Equinox itself)."""
    if "flax.linen" in sys.modules:
        from . import linen  # noqa: F401
    if "flax.nnx" in sys.modules:
        from . import nnx  # noqa: F401
    if "equinox" in sys.modules:
        from . import equinox  # noqa: F401


_reach.ADAPTER_IMPORTS.append(_import_adapters)

__all__ = [
    "upsample_bilinear2d",
    "avg_pool2d",
    "replication_pad2d",
    "roi_align",
    "group_norm_swish",
    "resize",
    "avg_pool",
    "pad",
    "reach",
]
