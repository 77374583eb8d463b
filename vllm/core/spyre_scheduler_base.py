"""What the Spyre schedulers share: the refusal of requests up front,
request checks and a view of the waiting queue.

Each Spyre mode's scheduler (static batching, continuous batching, pooling)
subclasses ``RefusingScheduler``, vLLM's V0 ``Scheduler`` that raises its
mode's ``refusal`` before queueing a request, and overrides the least it
can.  The static and continuous-batching schedulers refuse the same
unsupported sampling features (``refuse_unsupported``), and all three
narrow upstream's prefill scheduling to the requests they picked
(``waiting_only``).  With LoRA, upstream holds back a request whose
adapter would be one more than ``--max-loras`` in the running batch; the
Spyre schedulers say so once per request (``note_adapter_waits``), naming
the count and the limit.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Optional

from vllm.core.scheduler import Scheduler, SchedulerOutputs
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceGroup

logger = init_logger(__name__)


class RefusingScheduler(Scheduler):
    """vLLM's V0 scheduler refusing, before it queues them, the requests
    its mode could never schedule: a ``ValueError`` naming the value and
    the limit, which offline callers get directly and the OpenAI server
    answers with HTTP 400, instead of a request that waits forever."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: Waiting requests already said to wait for an adapter slot.
        self._adapter_waits: set[str] = set()

    def _schedule(self) -> SchedulerOutputs:
        """Upstream's, then (with LoRA) ``note_adapter_waits``."""
        outputs = super()._schedule()
        if self.lora_enabled:
            self.note_adapter_waits()
        return outputs

    def note_adapter_waits(self) -> None:
        """One log line for each waiting request that its adapter holds
        back: the running batch already runs ``--max-loras`` different
        adapters and its adapter is not one of them (it starts once the
        requests of one of them have finished)."""
        assert self.lora_config is not None
        limit = self.lora_config.max_loras
        running = {g.lora_int_id for g in self.running if g.lora_int_id > 0}
        if self._adapter_waits:  # forget the requests no longer waiting
            self._adapter_waits &= {g.request_id for g in self.waiting}
        if len(running) < limit:
            return
        for group in self.waiting:
            if (group.lora_int_id > 0 and group.lora_int_id not in running
                    and group.request_id not in self._adapter_waits):
                self._adapter_waits.add(group.request_id)
                logger.info(
                    "Request %s waits for an adapter slot: its adapter %r "
                    "would make %d different adapters in the running "
                    "batch, more than --max-loras=%d", group.request_id,
                    group.lora_request.lora_name, len(running) + 1, limit)

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        """Upstream's, after ``refusal`` found nothing to refuse."""
        reason = self.refusal(seq_group)
        if reason is not None:
            raise ValueError(reason)
        super().add_seq_group(seq_group)

    def refusal(self, seq_group: SequenceGroup) -> Optional[str]:
        """Why the mode can never schedule ``seq_group``, or None."""
        return None

    def refuse_parallel_samples(self, prompt_len: int,
                                params: SamplingParams) -> None:
        """Refuses a request whose ``n`` samples could never run side by
        side.  Called by the engine before it fans the request out into
        ``n`` groups of one sample (see ``vllm.engine.spyre_admission``)."""
        reason = self.parallel_samples_refusal(prompt_len, params)
        if reason is not None:
            raise ValueError(reason)

    def parallel_samples_refusal(self, prompt_len: int,
                                 params: SamplingParams) -> Optional[str]:
        """Why ``params.n`` samples can never run side by side, or None."""
        return None


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
