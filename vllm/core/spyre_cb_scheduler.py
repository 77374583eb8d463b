"""SpyreCBScheduler: vLLM's V0 scheduler under continuous batching on Spyre.

The platform installs this class as ``scheduler_config.scheduler_cls`` when
``VLLM_SPYRE_USE_CB=1``.  Upstream's scheduler already decides what Spyre
needs: a step is all prefill or all decode (a prefill step pauses decoding),
requests join the running batch whenever ``--max-num-seqs`` and the block
pool leave room, finished and aborted ones free their blocks at once, and
when blocks run out the newest running request is preempted and later
recomputed.  This class changes two things:

* ``add_seq_group`` refuses, with a ``ValueError``, a request that can
  never run (longer than ``max_model_len``, or more blocks than the whole
  pool) instead of letting upstream drop it with a warning, and
  ``refuse_parallel_samples`` one whose ``n`` samples could never decode
  side by side;
* ``_schedule_prefills`` admits one sequence per prefill step, as the card
  prefills one sequence at a time.
"""
from __future__ import annotations

from vllm.core.scheduler import (Scheduler, SchedulerPrefillOutputs,
                                 SchedulingBudget)
from vllm.core.spyre_scheduling import refuse_unsupported, waiting_only
from vllm.platforms.spyre_cb_blocks import (parallel_samples_reason,
                                            rejection_reason)
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceGroup


class SpyreCBScheduler(Scheduler):

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        """Refuses requests that could never be scheduled, up front."""
        refuse_unsupported(seq_group)
        params = seq_group.sampling_params
        prompt_len = seq_group.first_seq.get_prompt_len()
        if params is not None and params.max_tokens is None:
            # "As many as the context allows", as upstream stops them.
            params.max_tokens = self._max_tokens(prompt_len, params)
        reason = rejection_reason(
            prompt_len, params.max_tokens if params else 1,
            self.scheduler_config.max_model_len,
            self.cache_config.block_size, self._usable_blocks())
        if reason is not None:
            raise ValueError(reason)
        super().add_seq_group(seq_group)

    def refuse_parallel_samples(self, prompt_len: int,
                                params: SamplingParams) -> None:
        """Refuses a request whose ``n`` samples could never decode side by
        side.  Called by the engine before it fans the request out into
        ``n`` groups of one sample (see ``vllm.engine.spyre_admission``)."""
        reason = parallel_samples_reason(
            params.n, prompt_len, self._max_tokens(prompt_len, params),
            self.scheduler_config.max_num_seqs,
            self.cache_config.block_size, self._usable_blocks())
        if reason is not None:
            raise ValueError(reason)

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        if params.max_tokens is not None:
            return params.max_tokens
        return max(self.scheduler_config.max_model_len - prompt_len, 1)

    def _usable_blocks(self) -> int:
        manager = self.block_manager
        return manager.num_total_gpu_blocks - manager.watermark_blocks

    def _schedule_prefills(self, budget: SchedulingBudget, curr_loras,
                           enable_chunking: bool = False,
                           partial_prefill_metadata=None
                           ) -> SchedulerPrefillOutputs:
        """Upstream's prefill scheduling, shown only the oldest waiting
        request: one sequence per prefill step."""
        if len(self.waiting) <= 1:
            return super()._schedule_prefills(budget, curr_loras,
                                              enable_chunking,
                                              partial_prefill_metadata)
        with waiting_only(self, [self.waiting[0]]):
            return super()._schedule_prefills(budget, curr_loras,
                                              enable_chunking,
                                              partial_prefill_metadata)
