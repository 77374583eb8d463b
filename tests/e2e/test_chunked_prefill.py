"""Chunked prefill under continuous batching (``--enable-chunked-prefill``,
``--max-num-batched-tokens`` the chunk): a prompt longer than the chunk is
prefilled over several steps, each also decoding every running sequence,
so that running requests keep producing tokens while it joins.  Ids equal
transformers' for prompts of 1, 63, 64, 65 and 1,500 tokens with chunks
of 64 and 256 tokens, with and without prefix caching; the step table of
a long prompt joining three decoding requests; prompt log-probabilities
over chunks; nothing compiled after warm-up; a chunk that is not whole
blocks refused at start-up."""
from __future__ import annotations

import pytest
import torch

from spyre_support.engines import (compile_count, greedy_tokens, model_runner,
                                   spyre_llm)
from spyre_support.envs import backend_env
from spyre_support.reference import HFReference

MAX_MODEL_LEN = 1600
LENGTHS = [1, 63, 64, 65, 1500]
NEW = 8


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, 384, (n, ), generator=gen).tolist()


def chunked_llm(model, chunk: int, caching: bool = False,
                backend: str = "eager", **kwargs):
    return spyre_llm(model, {"VLLM_SPYRE_USE_CB": "1",
                             **backend_env(backend)},
                     max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                     enable_chunked_prefill=True,
                     max_num_batched_tokens=chunk,
                     enable_prefix_caching=caching, **kwargs)


def greedy(llm, prompts, max_tokens=NEW):
    return greedy_tokens(llm, prompts, max_tokens)


@pytest.fixture(scope="module")
def hf(tiny_llama_2k):
    return HFReference(tiny_llama_2k)



@pytest.fixture(scope="module")
def prompts():
    """The lengths of the issue, and a prompt sharing 700 tokens with the
    longest (10 blocks cached when prefix caching is on)."""
    out = [ids(n, n) for n in LENGTHS]
    return out + [out[-1][:700] + ids(100, 7)]


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache",
                                                        "prefix-cache"])
@pytest.mark.parametrize("chunk", [64, 256])
def test_ids_equal_transformers(tiny_llama_2k, hf, prompts, chunk,
                                caching):
    with chunked_llm(tiny_llama_2k, chunk, caching) as llm:
        before = compile_count()
        # One at a time (the shared prefix is cached by then), then all
        # together (prefills chunked while others decode).
        alone = [greedy(llm, [p])[0] for p in prompts]
        together = greedy(llm, prompts)
        assert compile_count() == before
        cached = [o.num_cached_tokens for o in alone]
    for prompt, a, b in zip(prompts, alone, together):
        ref = hf.greedy(prompt, NEW)[0]
        assert list(a.outputs[0].token_ids) == ref, len(prompt)
        assert list(b.outputs[0].token_ids) == ref, len(prompt)
    assert cached[-1] == (640 if caching else 0)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_running_requests_decode_between_the_chunks(tiny_llama_2k, hf,
                                                    backend):
    """Three requests decoding; a 1,000-token prompt joins with 256-token
    chunks.  Its prefill takes four steps (256, 256, 256, 232 positions),
    and each of them also decodes the three: none waits for the prompt."""
    from vllm import SamplingParams, TokensPrompt
    with chunked_llm(tiny_llama_2k, 256, backend=backend) as llm:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=30,
                                ignore_eos=True)
        short = [ids(10 + i, 20 + i) for i in range(3)]
        for i, p in enumerate(short):
            engine.add_request(f"short-{i}",
                               TokensPrompt(prompt_token_ids=p), params)
        for _ in range(3):  # their three prefills (one per step)
            engine.step()
        long = ids(1000, 30)
        engine.add_request("long", TokensPrompt(prompt_token_ids=long),
                           SamplingParams(temperature=0, max_tokens=NEW,
                                          ignore_eos=True))
        steps = []
        real_prepare = model_runner(llm).prepare_model_input

        def recording(*args, **kwargs):
            computed = model_runner(llm).prompt_tokens_computed
            model_input = real_prepare(*args, **kwargs)
            steps.append((model_runner(llm).prompt_tokens_computed - computed,
                          model_input.num_live))
            return model_input

        model_runner(llm).prepare_model_input = recording
        before = compile_count()
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
        assert compile_count() == before
    assert steps[:5] == [(256, 3), (256, 3), (256, 3), (232, 3), (0, 4)]
    for i, p in enumerate(short):
        assert list(outputs[f"short-{i}"].outputs[0].token_ids) == \
            hf.greedy(p, 30)[0]
    assert list(outputs["long"].outputs[0].token_ids) == \
        hf.greedy(long, NEW)[0]


def test_prompt_logprobs_over_chunks(tiny_llama_2k):
    """``prompt_logprobs`` of a 200-token prompt prefilled in 64-token
    chunks: one value per prompt token (the first None), equal to
    transformers' log-softmax."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams, TokensPrompt
    prompt = ids(200, 40)
    with chunked_llm(tiny_llama_2k, 64) as llm:
        (out, ) = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)],
            SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
            use_tqdm=False)
    values = out.prompt_logprobs
    assert len(values) == 200 and values[0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_2k,
                                                 dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[torch.arange(199),
                                        torch.tensor(prompt[1:])]
    got = torch.tensor([values[i][prompt[i]].logprob
                        for i in range(1, 200)])
    assert torch.allclose(got, ref, atol=1e-3)


def test_chunks_and_cached_prefixes_while_preempted(tiny_llama, hf_tiny):
    """Chunks of 64, prefix caching and a 7-block pool that four requests
    sharing a 128-token prefix outgrow while decoding: the scheduler
    preempts, recomputed requests are chunked again over their cached
    prefix, and every output is transformers'."""
    shared = ids(128, 50)
    prompts = [shared + ids(20 + 10 * i, 51 + i) for i in range(4)]
    with spyre_llm(tiny_llama, {"VLLM_SPYRE_USE_CB": "1",
                                **backend_env("eager")},
                   max_num_seqs=4, max_model_len=640,
                   enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=64,
                   num_gpu_blocks_override=7) as llm:
        outputs = greedy(llm, prompts, max_tokens=90)
        assert llm.llm_engine.scheduler[0].num_cumulative_preemption > 0
    for prompt, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == hf_tiny.greedy(prompt,
                                                                90)[0]


def test_tensor_parallel_with_prefix_caching(tiny_llama_2k, hf, prompts):
    """Two ranks, chunks of 128, prefix caching: every rank runs the same
    chunks and decodes; ids equal transformers'."""
    with chunked_llm(tiny_llama_2k, 128, caching=True,
                     tensor_parallel_size=2) as llm:
        alone = [greedy(llm, [p])[0] for p in prompts[-2:]]
    assert alone[-1].num_cached_tokens == 640
    for prompt, out in zip(prompts[-2:], alone):
        assert list(out.outputs[0].token_ids) == hf.greedy(prompt, NEW)[0]


@pytest.mark.parametrize("tokens", [100, 32, 1000])
def test_a_chunk_of_partial_blocks_is_refused_at_start_up(tiny_llama,
                                                          tokens):
    import os
    from unittest import mock

    from vllm import EngineArgs
    with mock.patch.dict(os.environ, {"VLLM_SPYRE_USE_CB": "1",
                                      **backend_env("eager")}):
        with pytest.raises(ValueError, match=(
                rf"--max-num-batched-tokens {tokens} is the prefill chunk "
                r"under --enable-chunked-prefill, and on Spyre it must be a "
                r"multiple of the block size, 64")):
            EngineArgs(model=str(tiny_llama), max_model_len=512,
                       max_num_seqs=4, enable_chunked_prefill=True,
                       max_num_batched_tokens=tokens).create_engine_config()
