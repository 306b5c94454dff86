"""`njit`: numba's compiler for the loops of the THL fast path (`fastspell.py`, `fastalign.py`), or, where
numba is absent, the identity.

Why compiled: right after a Rust encode, every distinct numpy call runs with cold caches (measured on
this project's 2-core machine: a 600-element cumsum takes 20 us instead of 5, a take 10 us instead of
1), so an alignment made of some forty small numpy calls cost several times the work inside it. Here
the work before the encode is one call and the work after it one more (numba, compiled once and
cached on disk; `warmup.py` compiles them when a bridge is built).

Numba's disk cache checks only the file of the function it compiled: a kernel that calls (or inlines) one
from another module keeps its cached code when only that other module changes.
"""

from __future__ import annotations

__all__ = ["njit"]

try:
    from numba import njit
except ImportError:  # the GPU check's offline wheelhouse leaves numba out (llvmlite alone is 58 MB): the same
    def njit(*args, **kwargs):  # loops then run as plain Python, slower and alike (NUMBA_DISABLE_JIT=1 tests that)
        return args[0] if args and callable(args[0]) else (lambda fn: fn)
