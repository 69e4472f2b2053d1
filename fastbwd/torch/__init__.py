"""fastbwd.torch: PyTorch models on fastbwd's backward kernels (docs/semantics.md §7).

Needs PyTorch: ``pip install torch`` (or ``pip install -e ".[torch]"`` in fastbwd's checkout). ``import fastbwd`` never imports torch; this module does.

* :func:`enable` / :func:`disable` / :func:`is_enabled` / :func:`enabled`: run the backward of
  ``F.interpolate(mode="bilinear")``, ``F.avg_pool2d``, ``F.pad(mode="replicate")`` and their
  modules on fastbwd, unchanged, wherever fastbwd is the faster (:func:`policy` ``"auto"``, the
  default) or wherever it can (``"always"``: PyTorch's own CPU kernels of
  ``upsample_bilinear2d_backward``, ``avg_pool2d_backward`` and ``replication_pad2d_backward``
  served by fastbwd); :func:`set_policy` or ``FASTBWD_POLICY`` chooses.
* :func:`group_norm_swish`, :class:`GroupNormSwish`: GroupNorm followed by Swish/SiLU with
  fastbwd's fused backward; :func:`fuse_group_norm_swish` puts them into a model (nn.Sequential
  pairs, and every other GroupNorm whose output goes only into a SiLU, as a
  :class:`FusedGroupNorm`, however the forward is written), returning a :class:`FusionReport`.
* :func:`roi_align`, :class:`RoIAlign`: ``torchvision.ops.roi_align`` on fastbwd's forward and
  backward kernels.
"""

try:
    import torch  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "fastbwd.torch needs PyTorch, which is not installed: pip install torch "
        '(or pip install -e ".[torch]" in fastbwd\'s checkout)'
    ) from error

# the graph operators and the hooks enable() installs; the eager routing of the policy "auto"
from . import _compile, _functional  # noqa: E402,F401
from ._fuse import FusedGroupNorm, FusionReport, fuse_group_norm_swish
from ._group_norm_swish import GroupNormSwish, group_norm_swish
from ._roi_align import RoIAlign, roi_align
from ._switch import disable, enable, enabled, is_enabled, policy, set_policy

__all__ = [
    "enable",
    "disable",
    "is_enabled",
    "enabled",
    "policy",
    "set_policy",
    "group_norm_swish",
    "GroupNormSwish",
    "fuse_group_norm_swish",
    "FusionReport",
    "FusedGroupNorm",
    "roi_align",
    "RoIAlign",
]
