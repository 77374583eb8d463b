"""End to end on a tiny random Llama: Spyre static batching through
``vllm.LLM`` gives the same greedy tokens as Hugging Face transformers, on
both CPU backends, with several warm-up shapes, more prompts than one batch
holds, mixed prompt lengths and ``max_tokens``; and serving after warm-up
compiles nothing.  Both backends run on the C++ kernels where they build;
``eager-torch-ops`` keeps PyTorch's own ops (``VLLM_SPYRE_NATIVE_KERNELS=0``)
and is compared the same way."""
from __future__ import annotations

import pytest
import torch

from spyre_support.engines import (collector_reach, compile_count,
                                   first_logprob, spyre_llm)
from spyre_support.envs import spyre_env, TORCH_OPS
from spyre_support.reference import HFReference

# Two shapes: short prompts in batches of 3, long prompts one at a time.
SHAPES = dict(prompt_lens=[64, 128], new_tokens=[12, 6], batch_sizes=[3, 1])
# Logprobs of the same tokens from two fp32 implementations.
LOGPROB_ATOL = 1e-3


def make_requests(vocab: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) pairs: 9 requests, prompt lengths from 1 to
    120, max_tokens from 1 to 12, so rows finish at different steps and
    both shapes are needed."""
    gen = torch.Generator().manual_seed(1234)
    plan = [(5, 12), (64, 7), (1, 3), (37, 12), (100, 6), (17, 1), (120, 4),
            (50, 9), (9, 12)]
    return [(torch.randint(4, vocab, (n, ), generator=gen).tolist(), m)
            for n, m in plan]


@pytest.fixture(scope="module", params=["eager", "inductor", TORCH_OPS])
def tiny_run(request, tiny_llama):
    """Generates every request once per backend; yields what was seen."""
    from vllm import SamplingParams, TokensPrompt
    backend = request.param
    at_start = compile_count()
    with spyre_llm(tiny_llama, spyre_env(backend, **SHAPES)) as llm:
        warmup_compiles = compile_count() - at_start
        vocab = llm.llm_engine.model_config.get_vocab_size()
        reqs = make_requests(vocab)
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
        params = [
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True,
                           logprobs=0) for _, m in reqs
        ]
        before = compile_count()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        compiled = compile_count() - before
        timings = llm.collective_rpc("get_startup_timings")[0]
        reach = collector_reach(llm, outputs)
        model = llm.llm_engine.model_executor.driver_worker.worker \
            .model_runner.model
        packed = sum(type(m).__name__ == "PackedLinear"
                     for m in model.code.fms_model.modules())
        fused = sum(type(m).__name__ == "KernelRMSNorm"
                    for m in model.code.fms_model.modules())
        kernels = dict(native=model.native, attn_name=model.code.attn_name,
                       packed=packed, fused_norms=fused,
                       rotary=type(model.code.fms_model.base_model.rot_emb)
                       .__name__)
    yield dict(backend=backend, reqs=reqs, outputs=outputs,
               compiled=compiled, warmup_compiles=warmup_compiles,
               timings=timings, kernels=kernels, reach=reach)


def test_both_backends_run_on_the_native_kernels(tiny_run):
    """eager skips the compiler, not the kernels: the linear layers are
    packed and decode attention is the C++ op on both CPU backends, and
    on eager the norms, the rotary embedding and the cache writes too;
    the torch-op path keeps MKL and the attention in torch ops."""
    from vllm.spyre_kernels import ops as native
    from vllm.attention.ops import spyre_static_cache as static_cache
    on = tiny_run["backend"] != TORCH_OPS and native.available()
    kernels = tiny_run["kernels"]
    assert kernels["native"] is on
    # eager, which fuses nothing itself, runs the norms and the rotary
    # embedding on kernels too, and the cache write and the attention one
    # C++ call each; inductor fuses them.
    fused = on and tiny_run["backend"] == "eager"
    assert kernels["attn_name"] == (
        static_cache.ATTN_NAME_EAGER_KERNEL if fused else
        static_cache.ATTN_NAME_CPU_KERNEL if on else static_cache.ATTN_NAME)
    assert (kernels["packed"] > 0) is on
    assert (kernels["fused_norms"] > 0) is fused
    assert kernels["rotary"] == ("KernelRotaryEmbedding" if fused
                                 else "RotaryEmbedding")


def test_greedy_ids_match_transformers(tiny_run, hf_tiny):
    for (prompt, max_tokens), out in zip(tiny_run["reqs"],
                                         tiny_run["outputs"]):
        ref_ids, _ = hf_tiny.greedy(prompt, max_tokens)
        got = list(out.outputs[0].token_ids)
        assert got == ref_ids, (
            f"{tiny_run['backend']}: prompt of {len(prompt)} tokens, "
            f"max_tokens={max_tokens}")


def test_logprobs_match_transformers(tiny_run, hf_tiny):
    for (prompt, max_tokens), out in zip(tiny_run["reqs"],
                                         tiny_run["outputs"]):
        _, ref_lp = hf_tiny.greedy(prompt, max_tokens)
        got = first_logprob(out.outputs[0])
        assert got == pytest.approx(ref_lp, abs=LOGPROB_ATOL)


def test_each_request_gets_exactly_max_tokens(tiny_run):
    for (_, max_tokens), out in zip(tiny_run["reqs"], tiny_run["outputs"]):
        assert len(out.outputs[0].token_ids) == max_tokens
        assert out.outputs[0].finish_reason == "length"


def test_no_compilation_after_warmup(tiny_run):
    # The counter is live: start-up compiled graphs, serving none.
    assert tiny_run["warmup_compiles"] > 0
    assert tiny_run["compiled"] == 0


def test_start_up_objects_are_left_out_of_collections(tiny_run):
    """What start-up made (the compiled graphs, the runner) is frozen, so
    a full collection while serving does not walk it; what serving makes
    still is collected."""
    reach = tiny_run["reach"]
    assert reach["frozen"] > 0 and not reach["runner"]
    assert reach["made_later"]


def test_every_shape_was_warmed_up(tiny_run):
    warmed = [k for k in tiny_run["timings"] if k.startswith("warmup")]
    assert len(warmed) == 2
    assert "load" in tiny_run["timings"]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_two_engines_of_one_family_in_one_process(tiny_llama, tmp_path,
                                                  backend):
    """Two engines on two Llamas with other weights, alive together in one
    process on the same shape: each generates its own model's tokens (with
    frozen inductor graphs, dynamo would otherwise run the second engine
    on the first one's graphs, weights included)."""
    import os
    from unittest import mock

    from vllm import LLM, SamplingParams, TokensPrompt
    from spyre_support.tiny_models import build_tiny_llama
    other = build_tiny_llama(tmp_path / "other", seed=1)
    env = spyre_env(backend, prompt_lens=[64], new_tokens=[6],
                    batch_sizes=[2])
    prompt = torch.randint(4, 300, (20, ),
                           generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with spyre_llm(tiny_llama, env) as first:
        with mock.patch.dict(os.environ, env):
            second = LLM(model=str(other))
        ids = [list(llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                                 params, use_tqdm=False)[0].outputs[0]
                    .token_ids) for llm in (first, second)]
        del second
    expected = [HFReference(path).greedy(prompt, 6)[0]
                for path in (tiny_llama, other)]
    assert ids == expected
    assert ids[0] != ids[1]
