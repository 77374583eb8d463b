"""SpyreStaticScheduler: vLLM's V0 scheduler with static batching on Spyre.

The platform installs this class as ``scheduler_config.scheduler_cls``.  It
changes only two decisions of the upstream ``Scheduler``:

* ``add_seq_group`` rejects, with a ``ValueError``, a request that no
  compiled warm-up shape can ever hold (offline callers see the exception,
  the OpenAI server answers HTTP 400), and ``refuse_parallel_samples`` one
  whose ``n`` samples are more than the largest batch;
* ``_schedule_prefills`` starts no new batch while a batch is decoding, and
  otherwise lets the upstream prefill logic see only the requests that
  ``select_batch`` picked to share one compiled shape.

Decoding, aborts, freeing and output bookkeeping are upstream's.
"""
from __future__ import annotations

from typing import Optional

from vllm.config.spyre import SpyreConfig, WarmupShape
from vllm.core.scheduler import SchedulerPrefillOutputs, SchedulingBudget
from vllm.core.spyre_scheduler_base import (RefusingScheduler,
                                           refuse_unsupported, waiting_only)
from vllm.core.spyre_static_shapes import (RequestSize,
                                           parallel_samples_reason,
                                           rejection_reason,
                                           select_batch)
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceGroup

logger = init_logger(__name__)


class SpyreStaticScheduler(RefusingScheduler):

    def __init__(self, *args, spyre_config: Optional[SpyreConfig] = None,
                 **kwargs) -> None:
        """``spyre_config`` is bound by the platform (``scheduler_cls`` is a
        ``functools.partial``), since the engine hands a scheduler only the
        scheduler, cache and LoRA configs."""
        super().__init__(*args, **kwargs)
        self.static_batching = spyre_config is not None
        self.warmup_shapes: tuple[WarmupShape, ...] = (
            spyre_config.warmup_shapes if self.static_batching else ())
        #: The shape of the batch now running (None when idle).
        self.current_shape: Optional[WarmupShape] = None

    def refusal(self, seq_group: SequenceGroup) -> Optional[str]:
        """A request that fits no compiled shape."""
        if not self.static_batching:
            return None
        refuse_unsupported(seq_group)
        self._resolve_max_tokens(seq_group)
        return rejection_reason(self._size(seq_group), self.warmup_shapes)

    def parallel_samples_refusal(self, prompt_len: int,
                                 params: SamplingParams) -> Optional[str]:
        """``n`` samples that could never share a batch."""
        if not self.static_batching:
            return None
        return parallel_samples_reason(params.n, self.warmup_shapes)

    def _schedule_prefills(self, budget: SchedulingBudget, curr_loras,
                           enable_chunking: bool = False,
                           partial_prefill_metadata=None
                           ) -> SchedulerPrefillOutputs:
        """Static batching: a new batch starts only when the last one has
        finished, and holds only requests that share one compiled shape."""
        if not self.static_batching:
            return super()._schedule_prefills(budget, curr_loras,
                                              enable_chunking,
                                              partial_prefill_metadata)
        if self.running or not self.waiting:
            if not self.running:
                self.current_shape = None
            return SchedulerPrefillOutputs.create_empty()

        waiting = list(self.waiting)
        picked = select_batch([self._size(g) for g in waiting],
                              self.warmup_shapes)
        if picked is None:
            # Cannot happen for requests admitted by add_seq_group.
            return SchedulerPrefillOutputs.create_empty()
        shape, indices = picked
        with waiting_only(self, [waiting[i] for i in indices]):
            outputs = super()._schedule_prefills(budget, curr_loras,
                                                 enable_chunking,
                                                 partial_prefill_metadata)
        if outputs.seq_groups:
            self.current_shape = shape
            logger.debug("Spyre batch of %d on shape %s",
                         len(outputs.seq_groups), shape)
        return outputs

    def _resolve_max_tokens(self, seq_group: SequenceGroup) -> None:
        """A request asking for "as many tokens as the context allows"
        (max_tokens omitted offline, or the OpenAI server's default of
        max_model_len - prompt) gets as many as the largest shape holding
        its prompt can produce.  An explicit smaller or larger max_tokens
        is never changed."""
        prompt_len = seq_group.first_seq.get_prompt_len()
        params = seq_group.sampling_params
        remaining = self.scheduler_config.max_model_len - prompt_len
        if params.max_tokens is not None and params.max_tokens != remaining:
            return
        fitting = [s.new_tokens for s in self.warmup_shapes
                   if s.prompt_len >= prompt_len]
        if fitting:
            params.max_tokens = min(max(fitting), max(remaining, 1))

    @staticmethod
    def _size(seq_group: SequenceGroup) -> RequestSize:
        return RequestSize(seq_group.first_seq.get_prompt_len(),
                           seq_group.sampling_params.max_tokens or 0)
