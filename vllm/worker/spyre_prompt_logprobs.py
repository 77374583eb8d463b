"""Prompt log-probabilities (``prompt_logprobs``, and the OpenAI server's
``echo`` with ``logprobs``) for the Spyre runners.

The compiled prefill graphs return the logits of each row's last position
only, which is all that sampling needs.  A request that asks for prompt
log-probabilities needs the logits of every prompt position, so the
runner gets them by a second pass over that request's prompt alone:

* FMS's model is called uncompiled (``prompt_logits``), without a cache
  (its causal attention over the prompt's own tokens, unpadded): nothing
  is compiled after warm-up, and the batch's key/value cache is left to
  the compiled prefill that fills it;
* the output head runs over ``SLICE`` positions at a time, so that the
  head's own output never exceeds ``SLICE`` rows of the vocabulary;
* only the requests that ask pay for the pass; the others' steps are
  unchanged.

vLLM's sampler then takes these logits as it takes a GPU runner's: for
each sequence group, in order, the rows of its prompt positions that
predict the next prompt token, then the row it samples from
(``sampler_logits``); the sampled row stays the compiled prefill's, so a
request samples the same token with or without prompt log-probabilities.
Tensor parallel ranks all run the pass (its layers exchange partial
results); only the driver samples.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from vllm.sequence import SequenceGroupMetadata

#: Positions per slice of the output head.
SLICE = 512


def wanted(metas: Sequence[SequenceGroupMetadata]) -> list[int]:
    """Indices of the sequence groups that ask for prompt
    log-probabilities."""
    return [
        i for i, m in enumerate(metas) if m.sampling_params is not None
        and m.sampling_params.prompt_logprobs is not None
    ]


@torch.no_grad()
def prompt_logits(fms_model: nn.Module, token_ids: torch.Tensor,
                  slice_len: int = SLICE) -> torch.Tensor:
    """Float32 logits ``[L, vocab]`` of every position of one prompt
    (``token_ids``, ``[L]``): FMS's model uncompiled, no cache, its head
    (and Granite's logits scaling) over ``slice_len`` positions at a
    time."""
    ids = token_ids.view(1, -1).to(torch.long)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    hidden, _ = fms_model.base_model(ids, positions, None, False)
    scale = getattr(fms_model.config, "logits_scaling", 1.0)
    out = []
    for start in range(0, ids.shape[1], slice_len):
        logits = fms_model.head(hidden[:, start:start + slice_len])
        out.append((logits / scale if scale != 1.0 else logits)[0].float())
    return torch.cat(out)


def sampler_logits(step_logits: torch.Tensor,
                   prompts: dict[int, torch.Tensor]) -> torch.Tensor:
    """The logits vLLM's sampler expects: ``step_logits`` holds the row
    each group samples from (``[groups, vocab]``, in group order);
    ``prompts`` maps a group asking for prompt log-probabilities to its
    ``prompt_logits``, whose rows but the last come before its sampled
    row."""
    if not prompts:
        return step_logits
    rows = []
    for i in range(step_logits.shape[0]):
        if i in prompts:
            rows.append(prompts[i][:-1].to(step_logits.dtype))
        rows.append(step_logits[i:i + 1])
    return torch.cat(rows)
