"""The thin public layer: one module per operator that validates, looks up the plan of the call's
geometry, allocates the result and runs the kernels' plan (docs/design.md, "The one contract").

The bridges call each module's ``plan`` and ``run``; besides them they need only the thread
count the kernels run on, which is Numba's, per calling thread (named here, so that nothing
outside ``fastbwd.kernels`` reaches into it).
"""

from ..kernels import get_num_threads, set_num_threads

__all__ = ["get_num_threads", "set_num_threads"]
