import os as _os

__version__ = "0.1.0"

# numpy's OpenBLAS workers spin for ~0.1 s after each call before they sleep, and the reducer calls numpy (the
# bootstrap's moments) and torch (the feature extractor, with its own threads) in turn once per record batch:
# the spinning workers held the cores torch's threads were waiting for, and the feature pass of a 50k reduce
# took 19 s instead of 8.5. 2**4 cycles puts them to sleep at once; the thread count and so every sum stay as
# they were. OpenBLAS reads this when numpy loads: it applies where specray is imported first (the CLI, jobs).
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
