"""Mamba-2 state slots of continuous batching, one per sequence.

A hybrid model's Mamba-2 layers keep a state per sequence (its
convolution history and SSM state, ``spyre_mamba``) in a pool of slots
allocated beside the key/value block pool: ``max_num_seqs`` slots, and a
spare one that padding rows write to.  ``StateSlots`` hands them out on
the driver worker:

* a sequence gets a slot when its prefill starts (position 0) and keeps
  it until its request finishes or is aborted (vLLM's
  ``finished_requests_ids``);
* a sequence preempted and recomputed starts its prefill from position 0
  again, in the slot it holds, from zero states (a prefill's first row is
  ``fresh``);
* the scheduler runs at most ``max_num_seqs`` sequences, and a preempted
  one waits ahead of every new request, so the slots suffice; running out
  is an error that names the count.
"""
from __future__ import annotations

from typing import Iterable


class StateSlots:
    """Slot of each request holding one; ``count`` slots, the spare one
    being ``count``."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"state slots: need at least 1, got {count}")
        self.count = count
        self.spare = count
        self._free = list(range(count - 1, -1, -1))
        self._held: dict[str, int] = {}

    def start(self, request_id: str) -> int:
        """The slot of a request whose prefill starts: the one it holds
        (a recomputed sequence), else a free one."""
        if request_id in self._held:
            return self._held[request_id]
        if not self._free:
            raise RuntimeError(
                f"All {self.count} Mamba-2 state slots are held (by "
                f"{sorted(self._held)}); request {request_id} cannot start")
        self._held[request_id] = slot = self._free.pop()
        return slot

    def of(self, request_id: str) -> int:
        try:
            return self._held[request_id]
        except KeyError:
            raise RuntimeError(f"request {request_id} holds no Mamba-2 "
                               "state slot (its prefill never started)"
                               ) from None

    def release(self, request_ids: Iterable[str]) -> None:
        """Frees the slots of finished or aborted requests."""
        for request_id in request_ids:
            slot = self._held.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    @property
    def held(self) -> int:
        return len(self._held)
