"""The one exception type for bad arguments (docs/semantics.md §0.4)."""

__all__ = ["ParamError", "ACLNN_ERR_PARAM_NULLPTR", "ACLNN_ERR_PARAM_INVALID"]

#: A required array or size argument is ``None``.
ACLNN_ERR_PARAM_NULLPTR = 161001
#: Every other bad argument.
ACLNN_ERR_PARAM_INVALID = 161002


class ParamError(ValueError, TypeError):
    """A bad argument to a fastbwd function.

    Subclasses both ``ValueError`` and ``TypeError`` (as ``numpy.exceptions.AxisError`` subclasses
    two), so existing ``except ValueError`` / ``except TypeError`` handlers catch it.

    Attributes
    ----------
    status : int
        The aclnn status code: 161001 (``ACLNN_ERR_PARAM_NULLPTR``) when a required argument is
        ``None``, 161002 (``ACLNN_ERR_PARAM_INVALID``) otherwise.
    param : str
        The name of the offending argument.
    """

    def __init__(self, message, *, status=ACLNN_ERR_PARAM_INVALID, param=None):
        super().__init__(message)
        self.status = status
        self.param = param

    def __reduce__(self):  # keep status/param across pickling (multiprocessing)
        return (_rebuild, (self.args[0], self.status, self.param))


def _rebuild(message, status, param):
    return ParamError(message, status=status, param=param)
