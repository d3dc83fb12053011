"""The data layout token_repeat's compiled screen shares with its Python side: the rows of its
findings and the entries of each request's n-gram table. Apart from both, so that the Python side
reads it without importing numba (the kernel module loads in the background).
"""

from __future__ import annotations

import numpy as np

# the kernel's findings: a row of FOUND_FIELDS (kind, batch wave index, slot, period or n,
# span or count) and the repeated block
KIND_LOOP, KIND_NGRAM = 0, 1
FOUND_FIELDS = 5

# an entry of a request's n-gram table: the n-gram's 32-bit hash, where it last started (its
# place in the history ring: it is in the window while it counts, and the ring holds the
# window), and its count in the window (0: an empty entry). 8 bytes, so that a request's table
# and ring stay in a few KiB of cache (the window is at most 4096 tokens: both fit 16 bits).
GRAM_ENTRY = np.dtype([("key", np.uint32), ("start", np.uint16), ("count", np.uint16)])
