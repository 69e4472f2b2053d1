"""What the installed PyTorch does where its releases differ, asked of PyTorch itself (once, on
empty CPU tensors: no kernel reads data) rather than read from its version string, so the
drop-ins follow the PyTorch they run with (docs/semantics.md §7, "Never breaks")."""

import torch

#: ``(no channels, no values per channel)``: for each, ``(exception type, message)`` of the
#: installed PyTorch's GroupNorm refusing such an input, or None where it accepts it; filled on
#: first use by :func:`group_norm_empty_error`.
_GROUP_NORM_EMPTY = None


def _group_norm_refusal(shape):
    try:
        torch.nn.functional.group_norm(torch.empty(shape), 1)
    except Exception as error:  # whatever PyTorch raises here, the drop-in raises too
        return type(error), str(error)
    return None


def group_norm_empty_error(shape):
    """The exception (a new instance, to raise) that the installed PyTorch's GroupNorm raises for
    an input of ``shape`` ``(N, C, *)`` with no channels or no values per channel, or None.

    PyTorch 2.14 refuses both (``Expected number of channels to be greater than 0, got 0``, then
    ``Expected HxW to be greater than 0, got 0``), after ``F.group_norm``'s own checks and before
    any other; 2.13 returned empty results. A rank-2 input has one value per channel."""
    global _GROUP_NORM_EMPTY
    if _GROUP_NORM_EMPTY is None:
        _GROUP_NORM_EMPTY = (_group_norm_refusal((1, 0, 1)), _group_norm_refusal((1, 1, 0)))
    no_channels, no_values = _GROUP_NORM_EMPTY
    if len(shape) < 2:  # not GroupNorm's to refuse here
        return None
    if no_channels is not None and shape[1] == 0:
        kind, message = no_channels
    elif no_values is not None and any(size == 0 for size in shape[2:]):
        kind, message = no_values
    else:
        return None
    return kind(message)
