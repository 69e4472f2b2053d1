"""fastbwd: exact, fast, parallel and bitwise-deterministic CPU kernels, written with Numba, for
five neural-network backward operators and the GroupNorm+Swish forward (the Huawei Ascend aclnn
operators; their semantics are in the checkout's ``docs/semantics.md``).

The NumPy functions (arrays in, NumPy arrays out; ``ArrayLike`` in the signatures is anything
``numpy.asarray`` accepts, PyTorch CPU tensors included):

- ``upsample_bilinear2d_backward``: the gradient of bilinear upsampling (``F.interpolate``)
- ``avg_pool2d_backward``: the gradient of 2-D average pooling
- ``replication_pad2d_backward``: the gradient of replication padding
- ``roi_align_backward``: the gradient of torchvision's ``roi_align``
- ``group_norm_swish_backward``: the gradient of GroupNorm followed by Swish (SiLU)
- ``group_norm_swish``: GroupNorm followed by Swish, forward (y, mean, rstd)
- ``precompile``: compile every kernel into the disk cache ahead of time
- ``clear_result_cache``: free the memory kept from dropped results (4 MiB and more) for reuse
- ``ParamError``: the one exception for bad arguments; ``__version__``

The bridges, imported on their own (``import fastbwd`` imports neither torch nor jax):

- ``fastbwd.torch``: PyTorch models train on these kernels: ``enable()`` routes PyTorch's own
  backward of bilinear upsampling, average pooling and replication padding to fastbwd;
  ``GroupNormSwish``/``group_norm_swish``, ``roi_align``/``RoIAlign`` and
  ``fuse_group_norm_swish`` for the fused operators.
- ``fastbwd.jax``: the five operators as JAX functions whose gradients run on these kernels
  under ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

Importing fastbwd compiles nothing; each kernel compiles on its first call and is cached on disk
(``fastbwd.precompile()`` or ``python -m fastbwd --precompile`` fills the cache ahead of time).
``python -m fastbwd`` checks each operator against the float64 reference.
"""

from ._errors import ParamError
from ._precompile import precompile
from ._result_cache import clear_result_cache
from ._version import __version__
from .api.avg_pool2d import avg_pool2d_backward
from .api.group_norm_swish import group_norm_swish, group_norm_swish_backward
from .api.replication_pad2d import replication_pad2d_backward
from .api.roi_align import roi_align_backward
from .api.upsample_bilinear2d import upsample_bilinear2d_backward

__all__ = [
    "ParamError",
    "__version__",
    "upsample_bilinear2d_backward",
    "avg_pool2d_backward",
    "replication_pad2d_backward",
    "roi_align_backward",
    "group_norm_swish_backward",
    "group_norm_swish",
    "precompile",
    "clear_result_cache",
]
