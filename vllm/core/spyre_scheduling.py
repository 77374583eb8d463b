"""What the Spyre schedulers share: request checks and a view of the
waiting queue.

Each Spyre mode's scheduler (static batching, continuous batching, pooling)
subclasses vLLM's V0 ``Scheduler`` and overrides the least it can.  The
static and continuous-batching schedulers refuse the same unsupported
sampling features (``refuse_unsupported``), and all three narrow upstream's
prefill scheduling to the requests they picked (``waiting_only``).
"""
from __future__ import annotations

import contextlib
from collections import deque

from vllm.core.scheduler import Scheduler
from vllm.sequence import SequenceGroup


def refuse_unsupported(seq_group: SequenceGroup) -> None:
    """Both Spyre schedulers refuse, up front, sampling features that would
    otherwise be ignored without a word: guided decoding that reached them
    without the logits processor admission gives it
    (``vllm.engine.spyre_structured_output``), which vLLM's V0 engine
    would not apply."""
    params = seq_group.sampling_params
    if params is None:
        return
    if params.guided_decoding is not None:
        raise ValueError(
            "Guided decoding reached the Spyre scheduler without its "
            "grammar: requests must enter through LLMEngine.add_request "
            "with the Spyre admission plugin installed, or the output "
            "would not follow the constraint.")


@contextlib.contextmanager
def waiting_only(scheduler: Scheduler, chosen: list[SequenceGroup]):
    """Upstream's prefill scheduling, inside the block, sees only
    ``chosen`` of the waiting queue; whatever it leaves waiting keeps its
    place ahead of the other waiting requests."""
    picked = {id(g) for g in chosen}
    rest = deque(g for g in scheduler.waiting if id(g) not in picked)
    scheduler.waiting = deque(chosen)
    try:
        yield
    finally:
        scheduler.waiting.extend(rest)
