"""Prompt log-probabilities (``prompt_logprobs``, and the OpenAI server's
``echo`` with ``logprobs``) for the Spyre runners.

The compiled prefill graphs return the logits of each row's last position
only, which is all that sampling needs.  A request that asks for prompt
log-probabilities needs every prompt position's, so the runner gets them
by a second pass over that request's prompt alone (``compute``):

* the model (FMS's, or vLLM's with ``--model-impl vllm``) is called
  uncompiled, without a cache (causal attention over the prompt's own
  tokens, unpadded): nothing is compiled after
  warm-up, and the batch's key/value cache is left to the compiled
  prefill that fills it;
* the output head, the log-softmax, the ranks and the top ``k`` run over
  ``SLICE`` positions at a time, and only the values asked for leave the
  slice: the memory a request adds stays that of one slice of the
  vocabulary, however long its prompt;
* only the requests that ask pay for the pass; the others' steps are
  unchanged, and the sampled token still comes from the compiled prefill,
  so a request samples the same token with or without them.

vLLM's sampler is then shown these requests without prompt
log-probabilities (``for_sampler``), and the runner puts the values into the sampler's output
(``attach``), in vLLM's form: per position after the first, the prompt
token's log-probability and rank, and the ``k`` most likely tokens (vLLM
adds the first position's None).  Tensor-parallel ranks all run the pass
(its layers exchange partial results); only the driver attaches.
"""
from __future__ import annotations

import copy
import itertools
from typing import Sequence

import torch
from torch import nn

from vllm.model_executor.layers.sampler import SamplerOutput
from vllm.sequence import Logprob, SequenceGroupMetadata

#: Positions per slice.
SLICE = 256


def wanted(metas: Sequence[SequenceGroupMetadata]) -> list[int]:
    """Indices of the sequence groups that ask for prompt
    log-probabilities."""
    return [
        i for i, m in enumerate(metas) if m.sampling_params is not None
        and m.sampling_params.prompt_logprobs is not None
    ]


def for_sampler(metas: list[SequenceGroupMetadata],
                asking: list[int]) -> list[SequenceGroupMetadata]:
    """The groups of a prefill as vLLM's sampler should see them: those
    asking for prompt log-probabilities (``asking``, from ``wanted``) as
    copies that do not ask (their sampling parameters cloned), so that it
    leaves their prompts to ``compute``; the engine's own requests are
    untouched."""
    seen = list(metas)
    for i in asking:
        meta = copy.copy(metas[i])
        meta.sampling_params = meta.sampling_params.clone()
        meta.sampling_params.prompt_logprobs = None
        seen[i] = meta
    return seen


@torch.no_grad()
def compute(model: nn.Module, token_ids: torch.Tensor, k: int,
            slice_len: int = SLICE) -> list[dict[int, Logprob]]:
    """For each position of one prompt (``token_ids``, ``[L]``) after the
    first: the log-probability and rank of its token given the tokens
    before it, and the ``k`` most likely tokens with theirs.  ``model``
    gives the prompt's hidden states and their logits
    (``prompt_hidden``, ``prompt_logits``)."""
    ids = token_ids.view(1, -1).to(torch.long)
    length = ids.shape[1]
    hidden = model.prompt_hidden(ids)
    out: list[dict[int, Logprob]] = []
    for start in range(0, length - 1, slice_len):
        end = min(start + slice_len, length - 1)
        logits = model.prompt_logits(hidden[:, start:end])
        logprobs = torch.log_softmax(logits, dim=-1)
        nxt = ids[0, start + 1:end + 1].unsqueeze(1)
        chosen = logprobs.gather(1, nxt)
        ranks = (logprobs > chosen).sum(dim=1).add_(1)
        rows = zip(nxt[:, 0].tolist(), chosen[:, 0].tolist(), ranks.tolist())
        if k > 0:
            top = logprobs.topk(k, dim=-1)
            tops = zip(top.indices.tolist(), top.values.tolist())
        else:
            tops = itertools.repeat(((), ()))
        for (token, value, rank), (top_ids, top_values) in zip(rows, tops):
            entry = {token: Logprob(value, rank)}
            for r, (t, v) in enumerate(zip(top_ids, top_values), 1):
                entry.setdefault(t, Logprob(v, r))
            out.append(entry)
    return out


def attach(output: SamplerOutput,
           computed: dict[int, list[dict[int, Logprob]]]) -> SamplerOutput:
    """Puts each group's ``compute`` result (by group index) into the
    sampler's output."""
    for i, values in computed.items():
        output.outputs[i].prompt_logprobs = values
    return output
