"""SpyreSampler against vLLM's own Sampler, on real SamplingMetadata.

Plain greedy steps must take the short path and return exactly what vLLM's
sampler returns (tokens, placeholder log-probabilities, structure); every
other step must go to vLLM's sampler."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.sampler import Sampler
from vllm.model_executor.layers.spyre_sampler import (SpyreSampler,
                                                      is_plain_greedy)
from vllm.model_executor.sampling_metadata import SamplingMetadata
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceData, SequenceGroupMetadata

VOCAB = 4000


def metadata(params: list[SamplingParams], is_prompt: bool,
             outputs: int = 3) -> SamplingMetadata:
    """One single-sequence group per entry of ``params``, as the Spyre
    model runner prepares them (prompt of 5 tokens, ``outputs`` generated
    so far on decode steps)."""
    metas = []
    for i, p in enumerate(params):
        out = [] if is_prompt else list(range(7, 7 + outputs))
        data = SequenceData.from_seqs([1, 2, 3, 4, 5], out)
        metas.append(SequenceGroupMetadata(request_id=f"r{i}",
                                           is_prompt=is_prompt,
                                           seq_data={10 + i: data},
                                           sampling_params=p,
                                           block_tables={10 + i: []}))
    lens = [5] * len(params) if is_prompt else None
    generators = {f"r{i}": torch.Generator().manual_seed(p.seed)
                  for i, p in enumerate(params) if p.seed is not None}
    return SamplingMetadata.prepare(metas, lens, lens, "cpu",
                                    pin_memory=False, generators=generators)


def logits_with_ties(rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, VOCAB, generator=gen) * 4
    # Row 0: an exact tie for the maximum; row 1: the two largest values
    # one float apart, the larger at the higher index.
    top = logits[0].max() + 1.0
    logits[0, 17], logits[0, 2500] = top, top
    if rows > 1:
        top = logits[1].max() + 1.0
        logits[1, 900] = top
        logits[1, 30] = torch.nextafter(top, torch.tensor(0.0))
    return logits


def as_plain(out) -> list:
    return [[(s.parent_seq_id, s.output_token,
              {t: (lp.logprob, lp.rank, lp.decoded_token)
               for t, lp in s.logprobs.items()}) for s in g.samples] +
            [g.prompt_logprobs] for g in out.outputs]


def both(params, is_prompt=False, rows=None, **kw):
    rows = rows or len(params)
    logits = logits_with_ties(rows)
    ref = Sampler()(logits.clone(), metadata(params, is_prompt, **kw))
    ours = SpyreSampler()(logits.clone(), metadata(params, is_prompt, **kw))
    return ref, ours


@pytest.mark.parametrize("is_prompt", [True, False])
@pytest.mark.parametrize("rows", [1, 4])
def test_greedy_matches_vllm_sampler(is_prompt, rows, monkeypatch):
    params = [SamplingParams(temperature=0.0, max_tokens=8)] * rows
    ref = Sampler()(logits_with_ties(rows), metadata(params, is_prompt))

    def fail(*args, **kwargs):
        raise AssertionError("plain greedy went to vLLM's sampler")

    monkeypatch.setattr(Sampler, "forward", fail)
    ours = SpyreSampler()(logits_with_ties(rows), metadata(params, is_prompt))
    assert as_plain(ours) == as_plain(ref)
    assert ours.outputs[0].samples[0].output_token in (17, 2500)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[17, 900]),
    SamplingParams(temperature=0.8, seed=3),
], ids=["logprobs", "repetition", "presence", "frequency", "min_tokens",
        "random"])
def test_other_steps_go_to_vllm_sampler(params):
    mixed = [SamplingParams(temperature=0.0), params]
    md = metadata(mixed, is_prompt=False)
    assert not is_plain_greedy(md)
    ref, ours = both(mixed)
    assert as_plain(ours) == as_plain(ref)


def test_min_tokens_already_reached_is_plain_greedy():
    params = [SamplingParams(temperature=0.0, min_tokens=2,
                             stop_token_ids=[17])]
    assert not is_plain_greedy(metadata(params, False, outputs=1))
    assert is_plain_greedy(metadata(params, False, outputs=2))
    ref, ours = both(params, outputs=2)
    assert as_plain(ours) == as_plain(ref)
