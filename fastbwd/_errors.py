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
    parts : tuple or None
        ``(function, subject, requirement, actual)``, the four parts of the message
        ``"<function>: <subject> <requirement>, but got <actual>"`` (docs/semantics.md §0.4),
        so that a bridge can say it in its own terms (``_validation.called_as``).
    """

    def __init__(self, message, *, status=ACLNN_ERR_PARAM_INVALID, param=None, parts=None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.parts = parts

    def __reduce__(self):  # keep status/param/parts across pickling (multiprocessing)
        return (_rebuild, (self.args[0], self.status, self.param, self.parts))


def _rebuild(message, status, param, parts=None):
    return ParamError(message, status=status, param=param, parts=parts)
