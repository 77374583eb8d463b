"""SpyreCBScheduler: vLLM's V0 scheduler under continuous batching on Spyre.

The platform installs this class as ``scheduler_config.scheduler_cls`` when
``VLLM_SPYRE_USE_CB=1``.  Upstream's scheduler already decides what Spyre
needs: a step is all prefill or all decode (a prefill step pauses
decoding), requests join the running batch whenever ``--max-num-seqs`` and
the block pool leave room, finished and aborted ones free their blocks at
once, and when blocks run out the newest running request is preempted and
later recomputed.  With ``--enable-prefix-caching`` its block manager
shares the full blocks of prompts between requests, and the runner
computes what they do not cover; with ``--enable-chunked-prefill`` a step
holds the running sequences' decodes and one chunk of a prefill
(upstream's chunked-prefill scheduling).  This class changes three things:

* ``add_seq_group`` refuses, with a ``ValueError``, a request that can
  never run (longer than ``max_model_len``, or more blocks than the whole
  pool) instead of letting upstream drop it with a warning, and
  ``refuse_parallel_samples`` one whose ``n`` samples could never decode
  side by side;
* ``_schedule_prefills`` admits one sequence per prefill step, as the card
  prefills one sequence at a time;
* under chunked prefill, every chunk is ``prefill_chunk`` tokens (the last
  one of a prompt what is left), whatever the step's decodes;
* with speculative decoding, a decoding sequence gets the lookahead slots
  of its proposals (``num_lookahead_slots``; upstream's V0 gives none).
"""
from __future__ import annotations

from typing import Optional

from vllm.core.scheduler import (SchedulerPrefillOutputs,
                                 SchedulerRunningOutputs, SchedulingBudget)
from vllm.core.spyre_cb_blocks import (parallel_samples_reason,
                                       rejection_reason)
from vllm.core.spyre_scheduler_base import (RefusingScheduler,
                                           refuse_unsupported, waiting_only)
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceGroup


class SpyreCBScheduler(RefusingScheduler):

    def __init__(self, *args, prefill_chunk: Optional[int] = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: The prefill chunk of chunked prefill (``--max-num-batched-tokens``,
        #: whole blocks), or None.  Upstream gives a prefill what the
        #: step's decodes leave of the token budget; the platform raised
        #: that budget by ``--max-num-seqs``, and every prefill slot gets
        #: the chunk, so that a prefill always advances a whole chunk.
        self.prefill_chunk = prefill_chunk
        self._prefill_continues = False
        if prefill_chunk is not None:
            self.partial_prefill_budget_lookup_list = [prefill_chunk] * len(
                self.partial_prefill_budget_lookup_list)

    def refusal(self, seq_group: SequenceGroup) -> Optional[str]:
        """A request longer than the model or the block pool allows."""
        refuse_unsupported(seq_group)
        params = seq_group.sampling_params
        prompt_len = seq_group.first_seq.get_prompt_len()
        if params is not None and params.max_tokens is None:
            # "As many as the context allows", as upstream stops them.
            params.max_tokens = self._max_tokens(prompt_len, params)
        return rejection_reason(
            prompt_len, params.max_tokens if params else 1,
            self.scheduler_config.max_model_len,
            self.cache_config.block_size, self._usable_blocks())

    def parallel_samples_refusal(self, prompt_len: int,
                                 params: SamplingParams) -> Optional[str]:
        """``n`` samples that could never decode side by side."""
        return parallel_samples_reason(
            params.n, prompt_len, self._max_tokens(prompt_len, params),
            self.scheduler_config.max_num_seqs,
            self.cache_config.block_size, self._usable_blocks())

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        if params.max_tokens is not None:
            return params.max_tokens
        return max(self.scheduler_config.max_model_len - prompt_len, 1)

    def _usable_blocks(self) -> int:
        manager = self.block_manager
        return manager.num_total_gpu_blocks - manager.watermark_blocks

    def _get_num_lookahead_slots(self, is_prefill: bool,
                                 enable_chunking: bool) -> int:
        """Slots beyond a decoding sequence's tokens: where the keys and
        values of its proposed tokens go (0 without speculation)."""
        return 0 if is_prefill else self.scheduler_config.num_lookahead_slots

    def _schedule_running(self, budget: SchedulingBudget, curr_loras,
                          enable_chunking: bool = False,
                          partial_prefill_metadata=None
                          ) -> SchedulerRunningOutputs:
        """Upstream's, noting whether a chunked prefill goes on this step."""
        out = super()._schedule_running(budget, curr_loras, enable_chunking,
                                        partial_prefill_metadata)
        self._prefill_continues = bool(out.prefill_seq_groups)
        return out

    def _schedule_prefills(self, budget: SchedulingBudget, curr_loras,
                           enable_chunking: bool = False,
                           partial_prefill_metadata=None
                           ) -> SchedulerPrefillOutputs:
        """Upstream's prefill scheduling, shown only the oldest waiting
        request: one sequence per prefill step, and none while a chunked
        prefill goes on."""
        if enable_chunking and self._prefill_continues:
            return SchedulerPrefillOutputs.create_empty()
        if len(self.waiting) <= 1:
            return super()._schedule_prefills(budget, curr_loras,
                                              enable_chunking,
                                              partial_prefill_metadata)
        with waiting_only(self, [self.waiting[0]]):
            return super()._schedule_prefills(budget, curr_loras,
                                              enable_chunking,
                                              partial_prefill_metadata)
