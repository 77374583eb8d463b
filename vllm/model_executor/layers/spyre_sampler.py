"""vLLM's sampler, with a short path for steps that are all plain greedy.

vLLM's ``Sampler`` builds its sampling tensors (temperatures, top-p/top-k,
penalties, ...) on every step and computes softmax and log-softmax over the
vocabulary before it looks at the sampling type.  For a decode step whose
requests are all greedy, with nothing that changes the logits or asks for
log-probabilities, that is host work larger than the argmax it needs
(measured: docs/performance.md, "Costs behind the design").

``SpyreSampler.forward`` takes such a step itself and returns exactly what
vLLM's sampler returns for it: the argmax of the float32 log-softmax (the
same ops, so the same token when logits tie after rounding) and, per
sequence, the placeholder log-probability vLLM records when none was asked
for.  Any other step goes to vLLM's sampler unchanged.
"""
from __future__ import annotations

from math import inf
from typing import Optional

import torch

from vllm.model_executor.layers.sampler import Sampler, SamplerOutput
# _SAMPLING_EPS: vLLM's threshold for "this sampling parameter is set".
from vllm.model_executor.sampling_metadata import (_SAMPLING_EPS,
                                                   SamplingMetadata,
                                                   SequenceGroupToSample)
from vllm.sampling_params import SamplingType
from vllm.sequence import (CompletionSequenceGroupOutput, Logprob,
                           SequenceOutput)


class SpyreSampler(Sampler):

    def forward(self, logits: torch.Tensor,
                sampling_metadata: SamplingMetadata) -> Optional[SamplerOutput]:
        if not is_plain_greedy(sampling_metadata):
            return super().forward(logits, sampling_metadata)
        groups = sampling_metadata.seq_groups
        rows = [g.sample_indices[0] for g in groups]
        logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float)
        tokens = torch.argmax(logprobs[rows], dim=-1).tolist()
        return SamplerOutput(outputs=[
            CompletionSequenceGroupOutput(
                [SequenceOutput(g.seq_ids[0], t, {t: Logprob(inf)})], None)
            for g, t in zip(groups, tokens)
        ])


def is_plain_greedy(sampling_metadata: SamplingMetadata) -> bool:
    """True if vLLM's sampler would take the argmax of every row and record
    no log-probability: every group greedy, one sequence, sampled this step,
    no logprobs or prompt logprobs, no penalties, no pending min_tokens."""
    if sampling_metadata.skip_sampler_cpu_output:
        return False
    groups = sampling_metadata.seq_groups
    return bool(groups) and all(_plain_greedy(g) for g in groups)


def _plain_greedy(group: SequenceGroupToSample) -> bool:
    params = group.sampling_params
    if (params.sampling_type != SamplingType.GREEDY or not group.do_sample
            or len(group.seq_ids) != 1 or len(group.sample_indices) != 1
            or params.logprobs is not None
            or params.prompt_logprobs is not None):
        return False
    if (abs(params.presence_penalty) >= _SAMPLING_EPS
            or abs(params.frequency_penalty) >= _SAMPLING_EPS
            or abs(params.repetition_penalty - 1.0) >= _SAMPLING_EPS):
        return False
    if params.min_tokens > 0 and params.all_stop_token_ids:
        data = group.seq_data[group.seq_ids[0]]
        if len(data.output_token_ids_array) < params.min_tokens:
            return False  # vLLM masks the stop tokens this step
    return True
