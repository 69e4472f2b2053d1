"""One thread budget for PyTorch's intra-op pool and Numba's (docs/semantics.md §7).

In a training step PyTorch's ops and fastbwd's kernels alternate on the same cores, each with
its own pool. The bridge runs fastbwd on as many threads as PyTorch uses
(``torch.get_num_threads()``, capped by the size of Numba's pool), so ``torch.set_num_threads``
sizes both and neither pool oversubscribes the cores the other was given.
"""

import numba
import torch

from .. import api


def match_torch_threads():
    """Set Numba's thread count (for the calling thread) to PyTorch's, within Numba's pool;
    returns that count."""
    wanted = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if api.get_num_threads() != wanted:
        api.set_num_threads(wanted)
    return wanted
