"""Index helpers shared by kernels (njit), named after their ATen counterparts where one exists."""

from ._jit import helper


@helper
def replicate_source_range(index, size, padded_size, pad_before):
    """The padded positions ``[start, stop)`` that replication padding copies from ``index``.

    Along one axis of length ``size`` padded by ``pad_before`` in front (negative pads crop),
    padded position ``i`` reads ``clamp(i - pad_before, 0, size - 1)``. The positions reading
    ``index`` form one range: the first and last index also collect the whole padded border.
    Returns an empty range (``start == stop``) when every reader was cropped away.
    """
    start = 0 if index == 0 else index + pad_before
    stop = padded_size if index == size - 1 else index + pad_before + 1
    start = min(max(start, 0), padded_size)
    stop = min(max(stop, start), padded_size)
    return start, stop
