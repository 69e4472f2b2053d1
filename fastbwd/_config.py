"""Environment switches, read once at import.

``FASTBWD_CACHE=0``   compile in memory only (no on-disk Numba cache).
``FASTBWD_SERIAL=1``  always run the serial twin of each kernel (never start Numba's thread pool).

Numba's own variables (``NUMBA_NUM_THREADS``, ``NUMBA_THREADING_LAYER``, ``NUMBA_CACHE_DIR``)
apply as usual.
"""

import os


def _flag(name, default):
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "no", "off")


CACHE = _flag("FASTBWD_CACHE", True)
SERIAL = _flag("FASTBWD_SERIAL", False)
