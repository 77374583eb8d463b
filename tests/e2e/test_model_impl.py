"""vLLM's own model code on Spyre (``--model-impl vllm``, the RFC's P5).

* SmolLM2 on vLLM's ``LlamaForCausalLM``: greedy ids equal to the FMS
  path's and to transformers', static and continuous batching (``eager``)
  and over 3 tensor-parallel ranks.
* The tiny Llama on ``inductor``: equal to transformers' in both modes,
  nothing compiled after warm-up, every layer's attention run inside the
  compiled graphs (no call of the attention from Python).
* Qwen2 and Phi-3, which FMS lacks, under ``--model-impl auto``: equal to
  transformers', static, continuous batching, and ``vllm serve`` (whose
  log names the implementation).
* Every architecture of ``spyre_model_impl.VLLM_ARCHITECTURES`` from a
  tiny random checkpoint with ``--model-impl vllm``: static, continuous
  batching and 3 ranks.

Each run also asks every rank what it ran (``probe``): vLLM's model class,
every linear layer and the output head (a tied Qwen2's too) on the packed
kernel.
* Prompt log-probabilities equal to the FMS path's; architectures and
  implementations Spyre does not run are refused at start-up.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from spyre_support.engines import (compile_count, greedy_requests, mode_llm,
                                   model_runner, spyre_llm)
from spyre_support.envs import spyre_env
from spyre_support.reference import HFReference
from spyre_support.tiny_models import build_tiny_family
from spyre_support.server import Server, served_ids

#: (prompt ids, new tokens): rows of different lengths finishing apart.
REQUESTS = [(list(range(5, 5 + n)), m)
            for n, m in ((9, 12), (60, 6), (2, 9), (33, 12))]
STATIC = dict(prompt_lens=[64], new_tokens=[12], batch_sizes=[4])
MAX_MODEL_LEN = 80  # the tiny Mistral's sliding window

#: Tiny checkpoint factory (``tiny_models``) of each vLLM architecture.
FACTORY = {
    "LlamaForCausalLM": "llama",
    "GraniteForCausalLM": "granite",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}


def reference(path) -> list[list[int]]:
    hf = HFReference(path)
    return [hf.greedy(p, m)[0] for p, m in REQUESTS]


def probe(worker) -> dict:
    """What a rank's model runs (for ``collective_rpc``): its model code's
    class, its output head's method, and how many linear layers were left
    off the kernels."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    code = worker.model_runner.model.code
    inner = getattr(code, "vllm_model", None)
    if inner is None:
        return dict(cls=type(code).__name__)
    return dict(cls=type(code).__name__,
                head=type(inner.lm_head.quant_method).__name__,
                left=sum(type(getattr(m, "quant_method", None)) is
                         UnquantizedLinearMethod for m in inner.modules()))


def on_vllm_code(ranks: list[dict]) -> bool:
    """Every rank ran vLLM's model class, every linear layer and the head
    on the packed kernel."""
    return all(r["cls"] == "VllmModelCode" and r["left"] == 0
               and r["head"] == "PackedHeadMethod" for r in ranks)


def run(path, mode: str, backend: str = "eager", **kwargs):
    """Greedy ids of REQUESTS, compilations after warm-up, and each rank's
    ``probe``."""
    with mode_llm(path, mode, backend, max_model_len=MAX_MODEL_LEN,
                  **STATIC, **kwargs) as llm:
        before = compile_count()
        got = greedy_requests(llm, REQUESTS)
        compiled = compile_count() - before
        return got, compiled, llm.collective_rpc(probe)


def test_every_listed_architecture_has_a_tiny_checkpoint():
    from vllm.model_executor.models.spyre_model_impl import \
        VLLM_ARCHITECTURES
    assert sorted(FACTORY) == sorted(VLLM_ARCHITECTURES)


@pytest.fixture(scope="module", params=sorted(FACTORY))
def architecture(request, tmp_path_factory):
    """(architecture, tiny checkpoint, transformers' greedy ids)."""
    name = FACTORY[request.param]
    path = build_tiny_family(name, tmp_path_factory.mktemp(name))
    return request.param, path, reference(path)


@pytest.mark.parametrize("mode, ranks", [("static", 1), ("cb", 1),
                                         ("static", 3)])
def test_every_architecture_on_vllm_model_code(architecture, mode, ranks):
    arch, path, expected = architecture
    got, _, probes = run(path, mode, model_impl="vllm",
                         tensor_parallel_size=ranks)
    assert got == expected, (arch, mode, ranks)
    assert len(probes) == ranks and on_vllm_code(probes), probes


def test_tied_head_on_the_kernel(tmp_path):
    """A tied Qwen2 head is its token embedding: its logits move to the
    packed kernel, its lookups keep the weight."""
    path = build_tiny_family("qwen2", tmp_path / "qwen2-tied", tied=True)
    got, _, probes = run(path, "cb")
    assert got == reference(path)
    assert on_vllm_code(probes), probes


@pytest.fixture(scope="module", params=["qwen2", "phi3"])
def vllm_only(request, tmp_path_factory):
    """A checkpoint of an architecture FMS lacks, and transformers' ids."""
    path = build_tiny_family(request.param,
                             tmp_path_factory.mktemp(request.param))
    return request.param, path, reference(path)


@pytest.mark.parametrize("mode", ["static", "cb"])
def test_auto_serves_architectures_fms_lacks(vllm_only, mode):
    name, path, expected = vllm_only
    got, _, probes = run(path, mode)
    assert got == expected, (name, mode)
    assert on_vllm_code(probes), probes


@pytest.mark.parametrize("vllm_only", ["phi3"], indirect=True)
def test_vllm_serve_names_the_implementation(vllm_only, tmp_path):
    """``vllm serve`` of a Phi-3 folder (the server's path is the same for
    Qwen2, whose outputs are proved offline above), all requests at
    once."""
    name, path, expected = vllm_only
    log = tmp_path / "serve.log"
    with Server(path, spyre_env("eager", **STATIC), log_path=log) as server:
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            got = list(pool.map(lambda r: served_ids(server, *r), REQUESTS))
    assert got == expected, name
    text = log.read_text()
    assert "Spyre model implementation: vLLM for" in text
    # The load's log line says where the time went.
    assert re.search(r"Loaded vLLM model \S+ from \S+ in [\d.]+ s \("
                     r"reading the weights: [\d.]+ s; building the model "
                     r"and finishing its layers", text), text[-2000:]


@pytest.mark.parametrize("mode", ["static", "cb"])
def test_tiny_llama_inductor_without_recompiling(tiny_llama, hf_tiny, mode,
                                                 monkeypatch):
    import torch
    from torch._dynamo.utils import counters

    from vllm.attention.backends.spyre_attn import SpyreAttentionImpl
    expected = [hf_tiny.greedy(p, m)[0] for p, m in REQUESTS]
    # Attention run from Python, not traced into a graph (vLLM's opaque
    # attention op would be), is counted.
    attend, outside = SpyreAttentionImpl.attend, []

    def counted(*args, **kwargs):
        if not torch.compiler.is_compiling():
            outside.append(1)
        return attend(*args, **kwargs)

    monkeypatch.setattr(SpyreAttentionImpl, "attend", counted)
    graphs = counters["stats"]["unique_graphs"]
    with mode_llm(tiny_llama, mode, "inductor", max_model_len=MAX_MODEL_LEN,
                  **STATIC, model_impl="vllm") as llm:
        # One graph per step kind: a break at attention would split each.
        graphs = counters["stats"]["unique_graphs"] - graphs
        names = model_runner(llm).model.expected_graphs()
        before = compile_count()
        got = greedy_requests(llm, REQUESTS)
        compiled = compile_count() - before
        probes = llm.collective_rpc(probe)
    assert got == expected, mode
    assert on_vllm_code(probes), probes
    assert compiled == 0, f"{compiled} compilations after warm-up ({mode})"
    assert graphs == len(names), (graphs, names)
    assert not outside, f"attention run outside the graphs {len(outside)} " \
        "times"


def test_tiny_llama_over_three_ranks(tiny_llama_3kv):
    """Continuous batching over 3 ranks (static: every architecture's
    test)."""
    got, _, probes = run(tiny_llama_3kv, "cb", model_impl="vllm",
                         tensor_parallel_size=3)
    assert got == reference(tiny_llama_3kv)
    assert len(probes) == 3 and on_vllm_code(probes), probes


def test_prompt_logprobs_equal_the_fms_path(tiny_llama):
    from vllm import SamplingParams, TokensPrompt
    prompt = TokensPrompt(prompt_token_ids=list(range(7, 47)))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    results = {}
    for impl in ("auto", "vllm"):
        with mode_llm(tiny_llama, "cb", "eager", max_model_len=MAX_MODEL_LEN,
                      **STATIC, model_impl=impl) as llm:
            results[impl] = llm.generate(prompt, params, use_tqdm=False)[0]
    fms, ours = results["auto"], results["vllm"]
    assert ours.outputs[0].token_ids == fms.outputs[0].token_ids
    assert len(ours.prompt_logprobs) == len(fms.prompt_logprobs) == 40
    for mine, theirs in zip(ours.prompt_logprobs[1:], fms.prompt_logprobs[1:]):
        assert mine.keys() == theirs.keys()
        for token, value in theirs.items():
            assert mine[token].rank == value.rank
            assert mine[token].logprob == pytest.approx(value.logprob,
                                                        abs=1e-4)


@pytest.mark.parametrize("family, impl, error, words", [
    ("gpt_bigcode", "vllm", ValueError,
     ["GPTBigCodeForCausalLM", "--model-impl vllm", "Phi3ForCausalLM"]),
    ("llama", "transformers", NotImplementedError,
     ["--model-impl transformers", "--model-impl auto"]),
])
def test_refused_at_start_up(tmp_path, family, impl, error, words):
    path = build_tiny_family(family, tmp_path / family)
    with pytest.raises(error) as info:
        with spyre_llm(path, spyre_env("eager", **STATIC), model_impl=impl):
            pass
    for word in words:
        assert word in str(info.value)


@pytest.fixture(scope="module")
def smollm2_expected(smollm2):
    hf = HFReference(smollm2)
    return [hf.greedy(p, m)[0] for p, m in REQUESTS]


@pytest.fixture(scope="module")
def smollm2_static_on_vllm_code(smollm2):
    """SmolLM2 on vLLM's model code, static batching, one rank: one engine
    for the two tests that compare it (with transformers, with FMS's
    model code)."""
    return run(smollm2, "static", model_impl="vllm")


@pytest.mark.smollm2
@pytest.mark.parametrize("mode, ranks", [("static", 1), ("cb", 1),
                                         ("static", 3)])
def test_smollm2_equals_transformers(request, smollm2, smollm2_expected,
                                     mode, ranks):
    if (mode, ranks) == ("static", 1):
        got, _, probes = request.getfixturevalue(
            "smollm2_static_on_vllm_code")
    else:
        got, _, probes = run(smollm2, mode, model_impl="vllm",
                             tensor_parallel_size=ranks)
    assert got == smollm2_expected, (mode, ranks)
    assert len(probes) == ranks and on_vllm_code(probes), probes


@pytest.mark.smollm2
def test_smollm2_equals_the_fms_path(smollm2, smollm2_static_on_vllm_code):
    """The same requests on FMS's model code (``auto``) and on vLLM's:
    the same ids."""
    fms, _, fms_probes = run(smollm2, "static")
    ours, _, probes = smollm2_static_on_vllm_code
    assert fms_probes == [dict(cls="FmsModelCode")]
    assert on_vllm_code(probes), probes
    assert ours == fms
