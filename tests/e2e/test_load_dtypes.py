"""A bfloat16 checkpoint served with ``--dtype bfloat16`` is read as it is
held (``spyre_dtypes.load_dtype``): the engine gives exactly the tokens and
log-probabilities of the same values read from a float32 checkpoint, in
static and continuous batching and over two tensor-parallel ranks, with a
head tied to the embedding; and the memory check counts the linear weights
at two bytes for both."""
from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams, TokensPrompt

from spyre_support.engines import compile_count, mode_llm
from spyre_support.tiny_models import build_bf16_valued_llama

PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(n)]
           for i, n in enumerate((9, 30, 57, 64))]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16-twins")
    return {dtype: build_bf16_valued_llama(root / str(dtype), dtype,
                                           tied=True)
            for dtype in (torch.bfloat16, torch.float32)}


def _serve(model, mode: str, **kwargs):
    with mode_llm(model, mode, "eager", [64], [16], [4], 128,
                  dtype="bfloat16", **kwargs) as llm:
        before = compile_count()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                           logprobs=0), use_tqdm=False)
        assert compile_count() == before
        weights = llm.collective_rpc("get_memory_estimate")[0].weights
        return ([list(o.outputs[0].token_ids) for o in outs],
                [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                 o.outputs[0].logprobs)]
                 for o in outs], weights)


@pytest.mark.parametrize("mode", ["static", "cb"])
def test_bf16_checkpoint_serves_as_its_float32_twin(twins, mode):
    ids, logprobs, narrow = _serve(twins[torch.bfloat16], mode)
    want_ids, want_logprobs, wide = _serve(twins[torch.float32], mode)
    assert ids == want_ids
    assert logprobs == want_logprobs
    # Linear weights at 2 bytes (and the tied head's packed copy) against
    # every weight at 4, as the float32 checkpoint holds them: the float32
    # twin's linear weights are converted to bfloat16 as they are read
    # (``spyre_dtypes.reads_linears_narrow``), so it is counted alike.
    stored = sum(f.stat().st_size
                 for f in twins[torch.float32].glob("*.safetensors"))
    assert narrow == wide < stored


def test_bf16_checkpoint_serves_as_its_float32_twin_under_tp(twins):
    """Each of two ranks reads its shard in bfloat16 (FMS's tensor-parallel
    modules), with the same result as the float32 read."""
    ids, logprobs, _ = _serve(twins[torch.bfloat16], "static",
                              tensor_parallel_size=2)
    want_ids, want_logprobs, _ = _serve(twins[torch.float32], "static",
                                        tensor_parallel_size=2)
    assert ids == want_ids
    assert logprobs == want_logprobs
