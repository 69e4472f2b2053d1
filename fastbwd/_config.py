"""Environment switches, read once at import.

``FASTBWD_CACHE=0``   compile in memory only (no on-disk Numba cache).
``FASTBWD_SERIAL=1``  always run the serial twin of each kernel (never start Numba's thread pool).
``FASTBWD_POLICY``    where the bridges send a call: ``auto`` (the default: to fastbwd where it is
                      the faster, ``fastbwd/_dispatch.py``) or ``always`` (every call fastbwd serves).

Numba's own variables (``NUMBA_NUM_THREADS``, ``NUMBA_THREADING_LAYER``, ``NUMBA_CACHE_DIR``)
apply as usual.
"""

import os
import warnings


def _flag(name, default):
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "no", "off")


CACHE = _flag("FASTBWD_CACHE", True)
SERIAL = _flag("FASTBWD_SERIAL", False)


def _policy():
    value = os.environ.get("FASTBWD_POLICY", "").strip().lower() or "auto"
    if value in ("auto", "always"):
        return value
    warnings.warn(
        f"FASTBWD_POLICY={value!r} is neither 'auto' nor 'always': 'auto' is used", RuntimeWarning, stacklevel=2
    )
    return "auto"


POLICY = _policy()
