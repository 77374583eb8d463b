"""The family registry without an engine: which configs map to which
family, the refusals, the sliding windows, and the Mixtral adapter step
against a state dict written by transformers."""
from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.models import spyre_families as sf


def config(**kw):
    return SimpleNamespace(model_type="x", **kw)


@pytest.mark.parametrize("arch, fms", [
    ("LlamaForCausalLM", "llama"), ("GraniteForCausalLM", "granite"),
    ("GPTBigCodeForCausalLM", "gpt_bigcode"),
    ("MistralForCausalLM", "mistral"), ("MixtralForCausalLM", "mixtral"),
    ("Qwen3ForCausalLM", "qwen3")])
def test_family_of_supported(arch, fms):
    assert sf.family_of(config(architectures=[arch])).fms_architecture == fms


def test_family_of_names_the_architecture_and_the_list():
    with pytest.raises(ValueError) as err:
        sf.family_of(config(architectures=["PhiForCausalLM"]))
    assert "Architecture PhiForCausalLM is not supported on Spyre" in str(
        err.value)
    assert "Qwen3ForCausalLM" in str(err.value)
    with pytest.raises(ValueError, match="model_type 'x'"):
        sf.family_of(config(architectures=None))


@pytest.mark.parametrize("arch, kw, window", [
    ("MistralForCausalLM", dict(sliding_window=4096), 4096),
    ("MistralForCausalLM", dict(sliding_window=None), None),
    ("Qwen3ForCausalLM", dict(sliding_window=4096,
                              use_sliding_window=False), None),
    ("Qwen3ForCausalLM", dict(sliding_window=4096,
                              use_sliding_window=True), 4096),
    ("LlamaForCausalLM", dict(sliding_window=4096), None),
])
def test_sliding_window(arch, kw, window):
    family = sf.FAMILIES[arch]
    assert family.sliding_window(config(architectures=[arch], **kw)) == window


@pytest.mark.parametrize("max_window_layers, window", [(0, 64), (4, None)])
def test_qwen3_window_follows_its_layer_types(max_window_layers, window):
    """transformers slides only the layers from ``max_window_layers`` on:
    all of them, or none."""
    from transformers import Qwen3Config
    cfg = Qwen3Config(num_hidden_layers=4, use_sliding_window=True,
                      sliding_window=64, max_window_layers=max_window_layers,
                      architectures=["Qwen3ForCausalLM"])
    assert sf.window_of(cfg) == window


def test_a_window_on_some_layers_only_is_refused():
    from transformers import Qwen3Config
    cfg = Qwen3Config(num_hidden_layers=4, use_sliding_window=True,
                      sliding_window=64, max_window_layers=1,
                      architectures=["Qwen3ForCausalLM"])
    with pytest.raises(NotImplementedError,
                       match="64 tokens on 3 of 4 layers.*max_window_layers=1"):
        sf.window_of(cfg)


def test_mixtral_step_stacks_experts_and_interleaves_rotary():
    heads, kv_heads, head_dim, dim, inner, experts = 2, 1, 4, 8, 6, 3
    g = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    sd = {
        "model.embed_tokens.weight": rand(10, dim),
        "model.layers.0.self_attn.q_proj.weight": rand(heads * head_dim, dim),
        "model.layers.0.self_attn.k_proj.weight": rand(kv_heads * head_dim,
                                                       dim),
        "model.layers.0.block_sparse_moe.gate.weight": rand(experts, dim),
        "lm_head.weight": rand(10, dim),
    }
    for e in range(experts):
        for w, shape in (("w1", (inner, dim)), ("w2", (dim, inner)),
                         ("w3", (inner, dim))):
            sd[f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"] = \
                rand(*shape)
    cfg = SimpleNamespace(nheads=heads, kvheads=kv_heads)
    out = sf._mixtral_transformers_to_original(sd, model_config=cfg)

    assert out["tok_embeddings.weight"] is sd["model.embed_tokens.weight"]
    assert out["output.weight"] is sd["lm_head.weight"]
    w1 = out["layers.0.block_sparse_moe.w1"]
    w2 = out["layers.0.block_sparse_moe.w2"]
    assert w1.shape == (experts * inner, dim) == w2.shape
    for e in range(experts):
        pre = f"model.layers.0.block_sparse_moe.experts.{e}"
        assert torch.equal(w1[e * inner:(e + 1) * inner],
                           sd[f"{pre}.w1.weight"])
        assert torch.equal(w2[e * inner:(e + 1) * inner],
                           sd[f"{pre}.w2.weight"].t())
    # Row r of head h in the original layout: rotary pair r // 2, element
    # r % 2; transformers keeps the first elements of every pair first.
    q = out["layers.0.attention.wq.weight"]
    hf_q = sd["model.layers.0.self_attn.q_proj.weight"]
    half = head_dim // 2
    for h in range(heads):
        for r in range(head_dim):
            src = h * head_dim + (r % 2) * half + r // 2
            assert torch.equal(q[h * head_dim + r], hf_q[src])
    # A state dict already in the original layout passes through.
    assert sf._mixtral_transformers_to_original(out, model_config=cfg) is out
