"""A kernel's parallel body and its serial twin, called as a plan's ``Launch`` calls them.

Tests that call a kernel directly (a partition or a twin compared bit for bit) go through a
``Launch``: the positions the plan passes read-only are typed read-only, so the test runs the
signature the package compiles and caches, not a writeable specialisation of its own (each one a
compile of several seconds in a cold run)."""

from fastbwd.kernels._jit import ONE_THREAD_BELOW, Launch


def parallel(kernel, read_only=(0,)):
    """``kernel``'s parallel body, as a launch of a large call runs it."""
    return Launch(kernel, ONE_THREAD_BELOW, read_only)


def serial(kernel, read_only=(0,)):
    """``kernel``'s serial twin, as a launch of a small call runs it."""
    return Launch(kernel, None, read_only)


def twins(kernel, read_only=(0,)):
    """(parallel, serial) of ``kernel``."""
    return parallel(kernel, read_only), serial(kernel, read_only)
