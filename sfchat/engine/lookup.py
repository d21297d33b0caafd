"""Prompt lookup: a continuation of the context found earlier in the context, at no draft cost.

Contract: ``lookup(context, length)`` finds the latest earlier occurrence of the context's last
few tokens (``LOOKUP_NGRAMS``, longest first, within the last ``LOOKUP_WINDOW`` tokens) and
returns up to ``length`` tokens that followed it ([] when there is none). It wins where a reply
repeats its context (summaries, retrieval, code edits): the speculator grafts it under the live
tree's root, where the tree lacks it. No models, no I/O.
"""

from __future__ import annotations

import numpy as np

LOOKUP_NGRAMS = (4, 3, 2)  # suffix lengths tried, longest first
LOOKUP_WINDOW = 8192  # tokens of context searched


def lookup(context: list[int], length: int) -> list[int]:
    """Up to ``length`` tokens that followed the latest earlier occurrence of the context's last
    ``LOOKUP_NGRAMS`` tokens (longest suffix first); [] when there is none."""
    if length <= 0:
        return []
    a = np.asarray(context[-LOOKUP_WINDOW:], dtype=np.int64)
    n = len(a)
    for g in LOOKUP_NGRAMS:
        if n <= g:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(a[:-1], g)  # starts 0 .. n - 1 - g
        hits = np.nonzero((windows == a[-g:]).all(axis=1))[0]
        if len(hits):
            j = int(hits[-1]) + g
            return a[j:j + length].tolist()
    return []
