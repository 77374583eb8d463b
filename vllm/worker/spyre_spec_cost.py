"""When a speculative verify step pays for itself.

A verify step scores ``k + 1`` positions of every running sequence, so it
costs more than a decode step, and more so at larger batches, where a
step's time is the positions' arithmetic rather than the weights' read:
on SmolLM2 on two cores a verify step of 5 positions cost 1.3 decode
steps at batch 1 and 4.4 at batch 8.  ``VerifyCost`` holds both steps'
times, measured at warm-up at the smallest and the largest batch (linear
in the batch between them), and each request's acceptance rate (proposals
kept over proposals made, ``PRIOR`` until its first verify step, then a
moving average).  A step verifies when the tokens it is expected to emit,
each sequence 1 plus its acceptance rate times its proposals, per second
of a verify step, beat a decode step's 1 token per sequence per second of
a decode step.

Pure bookkeeping; nothing here touches a model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

#: A request's acceptance rate before its first verify step.
PRIOR = 0.6
#: Weight of a verify step's outcome in a request's moving average.
WEIGHT = 0.3


@dataclass
class VerifyCost:
    """Seconds of a decode and a verify step at ``batches`` (smallest,
    largest), and each request's acceptance rate."""

    batches: tuple[int, int]
    decode_s: tuple[float, float]
    verify_s: tuple[float, float]
    rates: dict[str, float] = field(default_factory=dict)

    def _at(self, seconds: tuple[float, float], batch: int) -> float:
        low, high = self.batches
        if high == low:
            return seconds[0]
        share = (min(max(batch, low), high) - low) / (high - low)
        return seconds[0] + share * (seconds[1] - seconds[0])

    def ratio(self, batch: int) -> float:
        """A verify step's time over a decode step's at ``batch``."""
        return self._at(self.verify_s, batch) / self._at(self.decode_s,
                                                         batch)

    def pays(self, request_ids: Sequence[str],
             proposals: Sequence[int]) -> bool:
        """Whether verifying ``proposals`` (tokens proposed per running
        sequence, in step order) is expected to emit more tokens per
        second than a decode step."""
        batch = len(proposals)
        expected = sum(1 + self.rates.get(r, PRIOR) * m
                       for r, m in zip(request_ids, proposals))
        return expected > batch * self.ratio(batch)

    def verified(self, request_id: str, proposed: int,
                 accepted: int) -> None:
        """A verify step kept ``accepted`` of ``proposed`` tokens."""
        rate = self.rates.get(request_id, PRIOR)
        self.rates[request_id] = ((1 - WEIGHT) * rate +
                                  WEIGHT * accepted / proposed)

    def forget(self, request_ids) -> None:
        """Drops finished requests."""
        for request_id in request_ids:
            self.rates.pop(request_id, None)


def best_of(run: Callable[[], object], times: int = 5) -> float:
    """The shortest of ``times`` timed calls of ``run``, in seconds."""
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
