"""N-gram prompt lookup: a sequence's own tokens propose its next ones.

Speculative decoding with ``"method": "ngram"`` proposes, for each running
sequence, the tokens that followed an earlier occurrence of its last ``n``
tokens (prompt and output alike), for ``n`` from ``prompt_lookup_max`` down
to ``prompt_lookup_min``: the longest suffix that occurs earlier wins, and
of its occurrences the latest that ``k`` tokens follow (the one most
tokens follow where none has ``k``: in a run of one repeated token, the
latest occurrence of the suffix overlaps it and only one token follows).
Text that an answer repeats from its
prompt (an edited passage, extracted fields, code) is proposed whole.

A sequence whose proposals keep failing stops proposing for a while
(``Backoff``): after a verify step that accepted none of its proposals it
skips 1 step, after the next such step 2, then 4, up to 16; a step that
accepts one resets it.  On text with little to repeat, speculation thus
costs a verify step now and then rather than at every step.

Pure functions and per-request state; nothing here touches a model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

#: The longest pause of a sequence whose proposals keep failing (steps).
MAX_PAUSE = 16


def propose(tokens: Sequence[int], k: int, n_min: int,
            n_max: int) -> list[int]:
    """Up to ``k`` tokens to follow ``tokens``: those after the latest
    earlier occurrence, with ``k`` followers if any has, of its longest
    suffix of ``n_min`` to ``n_max`` tokens that occurs earlier; none if
    no such suffix does."""
    ids = np.asarray(tokens, dtype=np.int64)
    length = len(ids)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows that end before the last token: each has a follower.
        windows = sliding_window_view(ids[:length - 1], n)
        hits = np.flatnonzero((windows == ids[length - n:]).all(axis=1))
        if hits.size:
            # Tokens after each occurrence: length - (hit + n).
            whole = hits[hits + n + k <= length]
            start = int(whole[-1] if whole.size else hits[0]) + n
            return ids[start:start + k].tolist()
    return []


@dataclass
class _Pause:
    #: Steps still skipped, and the length of the next pause.
    left: int = 0
    next: int = 1


@dataclass
class Backoff:
    """Which requests propose this step (per request id)."""

    pauses: dict[str, _Pause] = field(default_factory=dict)

    def proposes(self, request_id: str) -> bool:
        """Whether ``request_id`` proposes this step (counts a skipped
        step down)."""
        pause = self.pauses.get(request_id)
        if pause is None or pause.left == 0:
            return True
        pause.left -= 1
        return False

    def verified(self, request_id: str, accepted: int) -> None:
        """A verify step accepted ``accepted`` of the request's
        proposals (it made some)."""
        if accepted:
            self.pauses.pop(request_id, None)
            return
        pause = self.pauses.setdefault(request_id, _Pause())
        pause.left = pause.next
        pause.next = min(pause.next * 2, MAX_PAUSE)

    def forget(self, request_ids) -> None:
        """Drops finished requests."""
        for request_id in request_ids:
            self.pauses.pop(request_id, None)
