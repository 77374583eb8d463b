"""``--dtype bfloat16`` on the CPU path: the weights of every matrix
product and the key/value cache in bfloat16 (the bytes a decode step
reads), the products on the packed bfloat16 kernel, and the residual
stream, norms, softmax and sums in float32.

bfloat16 keeps 8 bits of mantissa, so two correct bfloat16 engines may
pick different tokens wherever the top two logits are close.  The checks,
all teacher-forced on the sequence our engine generated (see
``docs/performance.md``, "bfloat16"):

* **stable positions equal transformers' bfloat16**: at every position
  where transformers' own bfloat16 top-1 logit leads the top-2 by more than
  twice its own bfloat16 error there (its largest logit difference from
  float32 on the same prefix), our greedy token equals transformers'
  bfloat16 argmax;
* **agreement with float32** (SmolLM2): our greedy token equals
  transformers' float32 argmax on at least 99 % of positions.

Static and continuous batching, ``eager`` and ``inductor``, and tensor
parallel over 3 ranks."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spyre_support.engines import compile_count, spyre_llm
from spyre_support.envs import spyre_env

from bf16_quality import TeacherForced

SHAPES = dict(prompt_lens=[64], new_tokens=[24], batch_sizes=[4])
NEW_TOKENS = 24
PROMPT_LENS = [5, 12, 30, 41, 60, 64, 17, 50]


def tiny_prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(4, vocab, (n, ), generator=gen).tolist()
            for n in PROMPT_LENS]


def generate(llm, prompts: list[list[int]],
             new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=new_tokens,
                                       ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def tf_tiny(tiny_llama):
    return TeacherForced(tiny_llama)


@pytest.fixture(scope="module")
def tf_tiny_3kv(tiny_llama_3kv):
    return TeacherForced(tiny_llama_3kv)


def check_stable_positions(judge: TeacherForced, prompts, generated,
                           least: int) -> None:
    judged = [judge.judge(p, g) for p, g in zip(prompts, generated)]
    stable = sum(sum(j.stable) for j in judged)
    # A check over a handful of positions would prove little.
    assert stable >= least, f"only {stable} stable positions"
    bad = {i: j.stable_mismatches() for i, j in enumerate(judged)
           if j.stable_mismatches()}
    assert not bad, f"prompt -> positions where ours != bf16 reference: {bad}"


def bf16_layers(llm) -> dict[str, int]:
    """How rank 0's model holds its tensors: linear layers by kind with
    bfloat16 weights, float32 linear layers left, and the dtypes of the
    remaining parameters and of the key/value cache."""

    def inspect(worker):
        from torch import nn

        from vllm.model_executor.layers.spyre_linear import (Bf16Linear,
                                                             PackedLinear)
        spyre = worker.model_runner.model
        model = spyre.code.fms_model
        mods = list(model.modules())
        return dict(
            packed=sum(isinstance(m, PackedLinear)
                       and m.packed.dtype == torch.bfloat16 for m in mods),
            onednn=sum(isinstance(m, Bf16Linear) for m in mods),
            float32_linear=sum(type(m) is nn.Linear for m in mods),
            others=sorted({str(p.dtype) for n, p in model.named_parameters()
                           if "weight" in n and p.dim() == 1}),
            kv=str(spyre.precision.kv))

    return llm.collective_rpc(inspect)[0]


MODES = [("static", "eager"), ("static", "inductor"), ("cb", "eager"),
         ("cb", "inductor")]


def mode_env(mode: str, backend: str) -> tuple[dict, dict]:
    if mode == "cb":
        return ({"VLLM_SPYRE_USE_CB": "1",
                 "VLLM_SPYRE_DYNAMO_BACKEND": backend},
                dict(max_model_len=128, max_num_seqs=4))
    return spyre_env(backend, **SHAPES), {}


@pytest.mark.parametrize("mode,backend", MODES)
def test_tiny_bf16_equals_transformers_bf16_where_stable(
        tiny_llama, tf_tiny, mode, backend):
    env, kwargs = mode_env(mode, backend)
    with spyre_llm(tiny_llama, env, dtype="bfloat16", **kwargs) as llm:
        held = bf16_layers(llm)
        # Every linear layer on the packed kernel, eager too: 2 layers x
        # (fused qkv, output, fused gate/up, down), and the head; the norms
        # stay float32.
        assert held["packed"] == 9 and held["float32_linear"] == 0, held
        assert held["others"] == ["torch.float32"]
        assert held["kv"] == "torch.bfloat16"
        prompts = tiny_prompts(llm.llm_engine.model_config.get_vocab_size())
        before = compile_count()
        generated = generate(llm, prompts)
        assert compile_count() == before, "compiled after warm-up"
    check_stable_positions(tf_tiny, prompts, generated, least=40)


@pytest.mark.parametrize("mode", ["static", "cb"])
def test_tiny_bf16_tp3_equals_transformers_bf16_where_stable(
        tiny_llama_3kv, tf_tiny_3kv, mode):
    env, kwargs = mode_env(mode, "inductor")
    with spyre_llm(tiny_llama_3kv, env, dtype="bfloat16",
                   tensor_parallel_size=3, **kwargs) as llm:
        prompts = tiny_prompts(llm.llm_engine.model_config.get_vocab_size())
        generated = generate(llm, prompts)
    check_stable_positions(tf_tiny_3kv, prompts, generated, least=40)


@pytest.mark.smollm2
def test_smollm2_bf16_agrees_with_float32(smollm2):
    """The prompts of ``benchmarks/bf16_quality.py`` (16 windows of 64
    tokens spread over the benchmark text, 64 new tokens each), on
    ``eager`` (the real model's inductor compile is the benchmark's job):
    teacher-forced top-1 agreement with transformers' float32 on at least
    99 % of positions, and transformers' bfloat16 wherever it is
    stable."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    text = (Path(__file__).resolve().parents[2] / "benchmarks" / "data" /
            "text.txt").read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    count, length = 16, 64
    stride = (len(ids) - length) // (count - 1)
    prompts = [ids[i * stride:i * stride + length] for i in range(count)]
    with spyre_llm(smollm2, spyre_env("eager", [64], [64], [8]),
                   dtype="bfloat16") as llm:
        generated = generate(llm, prompts, new_tokens=64)
    judge = TeacherForced(smollm2)
    judged = [judge.judge(p, g) for p, g in zip(prompts, generated)]
    positions = sum(len(j.ours) for j in judged)
    agree = sum(a == b for j in judged for a, b in zip(j.ours, j.fp32))
    assert positions == count * 64
    assert agree / positions >= 0.99, f"{agree} of {positions}"
    assert sum(sum(j.stable) for j in judged) >= positions // 2
    assert not [j.stable_mismatches() for j in judged
                if j.stable_mismatches()]
