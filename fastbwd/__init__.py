"""fastbwd: exact, fast, parallel, deterministic CPU kernels for five neural-network backward
operators (the Huawei Ascend aclnn operators of ``SPEC.md``), written with Numba.

Importing fastbwd compiles nothing and never imports torch; each kernel compiles on first use
and is cached on disk.
"""

from ._errors import ParamError
from ._version import __version__
from .api.replication_pad2d import replication_pad2d_backward

__all__ = [
    "ParamError",
    "__version__",
    "replication_pad2d_backward",
]
