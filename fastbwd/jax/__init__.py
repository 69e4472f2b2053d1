"""fastbwd.jax: JAX programs on CPU get fastbwd's backward kernels (docs/semantics.md §8).

Needs JAX: ``pip install jax`` (or ``pip install -e ".[jax]"`` in fastbwd's checkout). ``import fastbwd`` never imports jax; this module does.

Each function's forward is written in ``jax.numpy``/``lax`` (XLA fuses it with the rest of the
program; RoIAlign's forward is fastbwd's kernel) and its gradient is the fastbwd function, through
``jax.custom_vjp`` and XLA's FFI: the kernels read and write XLA's buffers in place. They work
under ``jax.jit``, ``jax.grad``/``jax.vjp`` and ``jax.vmap``, in float32, float64 (with x64
enabled), bfloat16 and float16, on the CPU.

* :func:`upsample_bilinear2d`: ``F.interpolate(mode="bilinear")``;
* :func:`avg_pool2d`: ``F.avg_pool2d``;
* :func:`replication_pad2d`: ``F.pad(mode="replicate")`` / ``jnp.pad(mode="edge")``;
* :func:`roi_align`: ``torchvision.ops.roi_align``;
* :func:`group_norm_swish`: GroupNorm followed by Swish/SiLU.
"""

try:
    import jax  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "fastbwd.jax needs JAX, which is not installed: pip install jax "
        '(or pip install -e ".[jax]" in fastbwd\'s checkout)'
    ) from error

from ._avg_pool import avg_pool, avg_pool2d
from ._group_norm_swish import group_norm_swish
from ._pad import pad, replication_pad2d
from ._reach import reach
from ._roi_align import roi_align
from ._upsample import resize, upsample_bilinear2d

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
