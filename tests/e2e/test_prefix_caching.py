"""Prefix caching under continuous batching (``--enable-prefix-caching``):
the full 64-token blocks of a prompt are shared between requests through
vLLM's prefix-caching block manager, and a prefill computes only what
they do not cover.  Every output equals transformers' greedy ids; the
runner's count of computed prompt positions shows exactly what was
skipped; prefixes cached on both sides of a block boundary, a prompt
cached whole, hits while requests are preempted and after aborts; after
every test, no block is referenced any more."""
from __future__ import annotations

import pytest
import torch

from spyre_support.engines import (compile_count, greedy_tokens, model_runner,
                                   spyre_llm)
from spyre_support.envs import cb_env

BLOCK = 64
MAX_MODEL_LEN = 640
NEW = 8


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, 384, (n, ), generator=gen).tolist()


def greedy(llm, prompts, max_tokens=NEW):
    return greedy_tokens(llm, prompts, max_tokens)


def gpu_allocator(llm):
    from vllm.utils import Device
    manager = llm.llm_engine.scheduler[0].block_manager
    return manager.block_allocator._allocators[Device.GPU]


def assert_no_block_referenced(llm) -> None:
    """Every block's reference count is zero, and every block is free
    (cached blocks wait in the evictor, which counts as free)."""
    allocator = gpu_allocator(llm)
    refs = {b: allocator._refcounter.get(b) for b in allocator.all_block_ids}
    assert not {b: r for b, r in refs.items() if r}, refs
    assert (allocator.get_num_free_blocks()
            == allocator.get_num_total_blocks())


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with spyre_llm(tiny_llama, cb_env("eager"), max_num_seqs=4,
                   max_model_len=MAX_MODEL_LEN,
                   enable_prefix_caching=True) as llm:
        yield llm


@pytest.fixture(autouse=True)
def fresh_cache(request):
    """Each test starts from an empty prefix cache and ends with no block
    referenced."""
    if "llm" not in request.fixturenames:
        yield
        return
    llm = request.getfixturevalue("llm")
    from vllm.utils import Device
    assert llm.llm_engine.scheduler[0].reset_prefix_cache(Device.GPU)
    yield
    assert_no_block_referenced(llm)


def assert_equal_hf(hf_tiny, prompts, outputs, max_tokens=NEW):
    for prompt, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == hf_tiny.greedy(
            prompt, max_tokens)[0], f"prompt of {len(prompt)} tokens"


def test_a_shared_system_prompt_is_computed_once(llm, hf_tiny):
    """Ten requests: a 400-token system prompt and each its own 20-token
    question.  The first computes all 420 positions; the nine others find
    the prompt's six full blocks (384 tokens) cached and compute 36."""
    from vllm.utils import Device
    system = ids(400, 1)
    prompts = [system + ids(20, 100 + i) for i in range(10)]
    before = model_runner(llm).prompt_tokens_computed
    outputs = greedy(llm, prompts)
    computed = model_runner(llm).prompt_tokens_computed - before
    assert computed == 420 + 9 * (420 - 384)
    assert [o.num_cached_tokens for o in outputs] == [0] + [384] * 9
    assert llm.llm_engine.scheduler[0].get_prefix_cache_hit_rate(
        Device.GPU) > 0
    assert_equal_hf(hf_tiny, prompts, outputs)


@pytest.mark.parametrize("shared, cached", [(0, 0), (63, 0), (64, 64),
                                            (65, 64), (127, 64),
                                            (128, 128)])
def test_a_cached_prefix_on_either_side_of_a_block_boundary(
        llm, hf_tiny, shared, cached):
    """A 200-token request, then one sharing its first ``shared`` tokens:
    only whole blocks are cached, and the second computes the rest."""
    first = ids(200, 2)
    second = first[:shared] + ids(150 - shared, 3)
    assert_equal_hf(hf_tiny, [first], greedy(llm, [first]))
    before = model_runner(llm).prompt_tokens_computed
    (out, ) = greedy(llm, [second])
    assert out.num_cached_tokens == cached
    assert model_runner(llm).prompt_tokens_computed - before == 150 - cached
    assert_equal_hf(hf_tiny, [second], [out])


@pytest.mark.parametrize("length", [64, 128, 192])
def test_a_prompt_cached_whole_computes_its_last_token(llm, hf_tiny,
                                                      length):
    """The same prompt twice, of whole blocks: the second run computes only
    its last position (for the logits) and leaves the shared block as it
    was: a third run still gives transformers' ids."""
    prompt = ids(length, 4)
    first = greedy(llm, [prompt])
    before = model_runner(llm).prompt_tokens_computed
    second = greedy(llm, [prompt])
    assert model_runner(llm).prompt_tokens_computed - before == 1
    assert second[0].num_cached_tokens == length
    third = greedy(llm, [prompt])
    for out in (first, second, third):
        assert_equal_hf(hf_tiny, [prompt], out)


def test_prompt_logprobs_on_a_cache_hit(llm):
    """A prompt whose first two blocks are cached still gets a value for
    every prompt token, equal to transformers' log-softmax."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams, TokensPrompt
    shared = ids(128, 14)
    prompt = shared + ids(20, 15)
    greedy(llm, [shared + ids(5, 16)])
    (out, ) = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
        use_tqdm=False)
    assert out.num_cached_tokens == 128
    assert len(out.prompt_logprobs) == 148 and out.prompt_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(
        llm.llm_engine.model_config.model, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[torch.arange(147),
                                        torch.tensor(prompt[1:])]
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob
                        for i in range(1, 148)])
    assert torch.allclose(got, ref, atol=1e-3)


def test_nothing_compiles_while_serving_with_cache_hits(llm):
    prompt = ids(150, 5)
    greedy(llm, [prompt])
    before = compile_count()
    greedy(llm, [prompt, prompt[:100] + ids(30, 6), prompt[:64]])
    assert compile_count() == before


def test_hits_after_aborts(llm, hf_tiny):
    """Requests sharing a prefix, two of them aborted after a few steps;
    the prefix is still cached for the next ones, and they are right."""
    from vllm import SamplingParams, TokensPrompt
    shared = ids(192, 7)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"abort-{i}", TokensPrompt(
            prompt_token_ids=shared + ids(10, 200 + i)), params)
    for _ in range(5):
        engine.step()
    engine.abort_request(["abort-0", "abort-2"])
    while engine.has_unfinished_requests():
        engine.step()
    prompts = [shared + ids(12, 300 + i) for i in range(3)]
    outputs = greedy(llm, prompts)
    assert [o.num_cached_tokens for o in outputs] == [192] * 3
    assert_equal_hf(hf_tiny, prompts, outputs)


def test_hits_while_requests_are_preempted(tiny_llama, hf_tiny):
    """Seven blocks for four requests that share a 128-token prefix and
    grow while decoding: the scheduler preempts, and recomputed requests
    find their prefix cached; every output is transformers'."""
    shared = ids(128, 8)
    prompts = [shared + ids(20 + 10 * i, 400 + i) for i in range(4)]
    with spyre_llm(tiny_llama, cb_env("eager"), max_num_seqs=4,
                   max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True,
                   num_gpu_blocks_override=7) as llm:
        outputs = greedy(llm, prompts, max_tokens=60)
        scheduler = llm.llm_engine.scheduler[0]
        assert scheduler.num_cumulative_preemption > 0
        assert_no_block_referenced(llm)
    assert_equal_hf(hf_tiny, prompts, outputs, max_tokens=60)


@pytest.mark.parametrize("backend", ["inductor"])
def test_a_shared_prefix_on_inductor(tiny_llama, hf_tiny, backend):
    """The paged C++ kernel under inductor, prefills starting after the
    cached blocks: transformers' ids, nothing compiled after warm-up."""
    system = ids(300, 9)
    prompts = [system + ids(15, 500 + i) for i in range(4)]
    with spyre_llm(tiny_llama, cb_env(backend), max_num_seqs=4,
                   max_model_len=MAX_MODEL_LEN,
                   enable_prefix_caching=True) as llm:
        before = compile_count()
        outputs = greedy(llm, prompts)
        assert compile_count() == before
        assert [o.num_cached_tokens for o in outputs] == [0] + [256] * 3
        assert_no_block_referenced(llm)
    assert_equal_hf(hf_tiny, prompts, outputs)


def test_unused_cached_blocks_are_evicted_least_recently_used(tiny_llama,
                                                              hf_tiny):
    """A pool of 6 blocks and prompts of two full blocks (three blocks
    with their answers): after A, B and C the pool must evict, and it
    evicts A's blocks, the least recently used; B is still cached when
    asked again, A is not."""
    a, b, c = ids(128, 10), ids(128, 11), ids(128, 12)
    with spyre_llm(tiny_llama, cb_env("eager"), max_num_seqs=2,
                   max_model_len=256, enable_prefix_caching=True,
                   num_gpu_blocks_override=6) as llm:
        for p in (a, b, c):
            greedy(llm, [p])
        again_b = greedy(llm, [b])[0]
        again_a = greedy(llm, [a])[0]
        assert_no_block_referenced(llm)
    assert again_b.num_cached_tokens == 128
    assert again_a.num_cached_tokens < 128
    assert_equal_hf(hf_tiny, [b, a], [again_b, again_a])


def test_the_server_with_prefix_caching_and_chunked_prefill(tiny_llama,
                                                            hf_tiny):
    """``vllm serve --enable-prefix-caching --enable-chunked-prefill
    --enable-prompt-tokens-details``: the openai client's completions
    sharing a 300-token system prompt give transformers' ids, and each
    reports the cached tokens of its prompt (256 after the first)."""
    import openai

    from spyre_support.server import Server
    system = ids(300, 13)
    prompts = [system + ids(10, 600 + i) for i in range(3)]
    with Server(tiny_llama, cb_env("eager"),
                args=("--max-num-seqs", "4", "--max-model-len", "512",
                      "--enable-prefix-caching", "--enable-chunked-prefill",
                      "--max-num-batched-tokens", "128",
                      "--enable-prompt-tokens-details")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused",
                               max_retries=0)
        outs = [client.completions.create(
            model=srv.model, prompt=p, max_tokens=NEW, temperature=0,
            logprobs=0, extra_body=dict(ignore_eos=True,
                                        return_tokens_as_token_ids=True))
            for p in prompts]
    cached = [(o.usage.prompt_tokens_details.cached_tokens
               if o.usage.prompt_tokens_details else 0) for o in outs]
    assert cached == [0, 256, 256]
    for p, out in zip(prompts, outs):
        got = [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]
        assert got == hf_tiny.greedy(p, NEW)[0]
