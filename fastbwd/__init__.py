"""fastbwd: exact, fast, parallel, deterministic CPU kernels for five neural-network backward
operators and the GroupNorm+Swish forward (the Huawei Ascend aclnn operators described in
``docs/semantics.md``), written with Numba.

Importing fastbwd compiles nothing and never imports torch; each kernel compiles on first use
and is cached on disk (``fastbwd.precompile()`` or ``python -m fastbwd --precompile`` fills the
cache ahead of time).
"""

from ._errors import ParamError
from ._precompile import precompile
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
]
