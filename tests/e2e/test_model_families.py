"""Every FMS decoder family beside Llama, end to end: a tiny random
checkpoint of each (``tiny_models.FAMILIES``) generates the same greedy
tokens as Hugging Face transformers under static batching (two shapes,
``eager``; one shape, ``inductor``), continuous batching, tensor
parallelism over 3 ranks, and (two of them) through ``vllm serve``.
The tiny Mistral's sliding window is longer than the sequences it serves
(test_sliding_window serves one they outgrow); an architecture Spyre does
not run is refused at start-up.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from spyre_support.engines import compile_count, spyre_llm
from spyre_support.envs import cb_env, spyre_env
from spyre_support.reference import HFReference
from spyre_support.tiny_models import build_tiny_family
from spyre_support.server import Server, served_ids
from spyre_support.tiny_models import FAMILIES

# Short prompts four at a time, longer answers two at a time.
STATIC = dict(prompt_lens=[64, 64], new_tokens=[8, 16], batch_sizes=[4, 2])
ONE_SHAPE = dict(prompt_lens=[64], new_tokens=[16], batch_sizes=[3])
CB_ENV = cb_env("eager")
CB_ARGS = dict(max_model_len=80, max_num_seqs=3)


def make_requests() -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): 6 requests of 2 to 60 tokens and 1 to 16
    new tokens, so rows finish at different steps."""
    gen = torch.Generator().manual_seed(7)
    plan = [(9, 16), (60, 8), (2, 5), (33, 16), (17, 1), (48, 12)]
    return [(torch.randint(4, 380, (n, ), generator=gen).tolist(), m)
            for n, m in plan]


REQUESTS = make_requests()


def generate(llm) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in REQUESTS]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for _, m in REQUESTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint folder, Hugging Face greedy ids of REQUESTS)."""
    name = request.param
    path = build_tiny_family(name, tmp_path_factory.mktemp(name))
    hf = HFReference(path)
    expected = [hf.greedy(p, m)[0] for p, m in REQUESTS]
    del hf
    return name, path, expected


def test_static_eager_matches_transformers(family):
    name, path, expected = family
    with spyre_llm(path, spyre_env("eager", **STATIC)) as llm:
        assert generate(llm) == expected, name


def check_without_recompiling(family, env: dict, **kwargs) -> None:
    """Greedy ids equal transformers', and nothing compiles after
    warm-up."""
    name, path, expected = family
    with spyre_llm(path, env, **kwargs) as llm:
        before = compile_count()
        got = generate(llm)
        compiled = compile_count() - before
    assert got == expected, name
    assert compiled == 0, f"{name}: {compiled} compilations after warm-up"


def test_static_inductor_matches_transformers_without_recompiling(family):
    check_without_recompiling(family, spyre_env("inductor", **ONE_SHAPE))


def test_continuous_batching_matches_transformers(family):
    name, path, expected = family
    with spyre_llm(path, CB_ENV, **CB_ARGS) as llm:
        assert generate(llm) == expected, name


def test_continuous_batching_inductor_without_recompiling(family):
    check_without_recompiling(
        family, {**CB_ENV, "VLLM_SPYRE_DYNAMO_BACKEND": "inductor"},
        **CB_ARGS)


def test_tp3_matches_transformers(family):
    name, path, expected = family
    with spyre_llm(path, spyre_env("eager", **ONE_SHAPE),
                   tensor_parallel_size=3) as llm:
        assert generate(llm) == expected, name


# Every family's outputs are proved offline above; the server's path is the
# same for each, so it serves two: the one loaded through Spyre's own
# checkpoint adapter (Mixtral) and the newest (Granite 4).
SERVED = ["mixtral", "granite4"]


@pytest.mark.parametrize("family", SERVED, indirect=True)
def test_vllm_serve_matches_transformers(family, tmp_path):
    """The OpenAI server on loopback, all requests at once."""
    name, path, expected = family
    with Server(path, spyre_env("eager", **ONE_SHAPE),
                log_path=tmp_path / "serve.log") as server:
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            got = list(pool.map(lambda r: served_ids(server, *r), REQUESTS))
    assert got == expected, name


def test_other_architectures_are_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from spyre_support.tiny_models import build_tokenizer
    tokenizer = build_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32,
                               n_layer=1, n_head=2)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        with spyre_llm(tmp_path, spyre_env("eager", [64], [8], [1])):
            pass
    message = str(err.value)
    assert "Architecture GPT2LMHeadModel is not supported on Spyre" in message
    for arch in ("LlamaForCausalLM", "GraniteForCausalLM",
                 "GPTBigCodeForCausalLM", "MistralForCausalLM",
                 "MixtralForCausalLM", "Qwen3ForCausalLM"):
        assert arch in message
