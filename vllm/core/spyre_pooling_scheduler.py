"""SpyrePoolingScheduler: vLLM's V0 scheduler for pooling models on Spyre.

The platform installs this class for embedding and cross-encoder models
(vLLM's pooling runner).  A pooling request is one forward pass, no
decoding, so a step is a set of texts that ``select_texts`` packs into one
compiled warm-up shape.  It changes two decisions of the upstream
``Scheduler``:

* ``add_seq_group`` refuses, with a ``ValueError`` naming the length and
  the compiled prompt lengths, a text longer than every shape (offline
  callers see the exception, the OpenAI server answers HTTP 400);
* ``_schedule_prefills`` lets the upstream prefill logic see only the
  waiting texts that ``select_texts`` picked to share one shape.

Everything else (budgets, aborts, outputs) is upstream's.
"""
from __future__ import annotations

from typing import Optional

from vllm.config.spyre import SpyreConfig, WarmupShape
from vllm.core.scheduler import SchedulerPrefillOutputs, SchedulingBudget
from vllm.core.spyre_pooling_shapes import rejection_reason, select_texts
from vllm.core.spyre_scheduler_base import RefusingScheduler, waiting_only
from vllm.sequence import SequenceGroup


class SpyrePoolingScheduler(RefusingScheduler):

    def __init__(self, *args, spyre_config: Optional[SpyreConfig] = None,
                 **kwargs) -> None:
        """``spyre_config`` is bound by the platform (``scheduler_cls`` is a
        ``functools.partial``)."""
        super().__init__(*args, **kwargs)
        self.packing = spyre_config is not None
        self.warmup_shapes: tuple[WarmupShape, ...] = (
            spyre_config.warmup_shapes if self.packing else ())

    def refusal(self, seq_group: SequenceGroup) -> Optional[str]:
        """A text that fits no compiled shape."""
        if not self.packing:
            return None
        return rejection_reason(seq_group.first_seq.get_prompt_len(),
                                self.warmup_shapes)

    def _schedule_prefills(self, budget: SchedulingBudget, curr_loras,
                           enable_chunking: bool = False,
                           partial_prefill_metadata=None
                           ) -> SchedulerPrefillOutputs:
        """The next step runs the waiting texts that share one shape."""
        if not self.packing or not self.waiting:
            return super()._schedule_prefills(budget, curr_loras,
                                              enable_chunking,
                                              partial_prefill_metadata)
        waiting = list(self.waiting)
        picked = select_texts(
            [g.first_seq.get_prompt_len() for g in waiting],
            self.warmup_shapes, self.scheduler_config.max_num_seqs)
        with waiting_only(self, [waiting[i] for i in picked]):
            return super()._schedule_prefills(budget, curr_loras,
                                              enable_chunking,
                                              partial_prefill_metadata)
