"""``spyre_tp_dims``: a tensor-parallel size that does not split a
decoder's heads, MLP, experts or vocabulary is refused with the dimension,
its value and the sizes that work; the family table gives each family's
dimensions; the platform refuses before the engine (and any rank) starts.
Configs only: no checkpoint is loaded."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.model_executor.models import spyre_tp_dims as tp
from vllm.model_executor.models.spyre_families import family_of


def llama(**fields):
    base = dict(architectures=["LlamaForCausalLM"], num_attention_heads=32,
                num_key_value_heads=8, hidden_size=4096,
                intermediate_size=14336, vocab_size=128256)
    return SimpleNamespace(**dict(base, **fields))


def refusal(dims, size) -> str:
    with pytest.raises(ValueError) as e:
        tp.check(dims, size)
    return str(e.value)


def test_sizes_that_split_a_llama():
    dims = family_of(llama()).tp_dims(llama())
    assert tp.sizes_that_work(dims) == [1, 2, 4, 8, 16, 32]
    for size in (1, 2, 4, 8):
        tp.check(dims, size)


@pytest.mark.parametrize("fields, size, named", [
    # Key/value heads: a multiple or a divisor of the size.
    (dict(num_key_value_heads=3, num_attention_heads=6, hidden_size=96,
          intermediate_size=192), 2,
     "key/value heads (num_key_value_heads = 3)"),
    # An MLP width that 3 ranks cannot split.
    (dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=96,
          intermediate_size=200), 3, "MLP width (intermediate_size = 200)"),
])
def test_a_dimension_that_does_not_split_is_named(fields, size, named):
    config = llama(**fields)
    message = refusal(family_of(config).tp_dims(config), size)
    assert message.startswith(f"Tensor parallel size {size} cannot split")
    assert named in message
    assert "Tensor parallel sizes that work: 1" in message


def test_kv_heads_fewer_than_the_ranks_are_copied():
    dims = tp.attention(llama(num_attention_heads=8, num_key_value_heads=2))
    tp.check(dims, 4)  # each rank holds one of the 2 heads
    # 3 key/value heads over 9 ranks: each copied to 3 ranks.
    tp.check(tp.attention(llama(num_attention_heads=9,
                                num_key_value_heads=3)), 9)
    assert "key/value heads (num_key_value_heads = 2)" in refusal(
        tp.attention(llama(num_attention_heads=6, num_key_value_heads=2)), 3)


def test_fms_width_split_by_its_ratio():
    """FMS gives each rank int(W / hidden / N * hidden) rows: 384 over
    3 ranks with hidden 320 would give 127 rows each, though 384 % 3 is 0;
    vLLM's own layers split it exactly."""
    width = tp.TPDim("MLP width", "intermediate_size", 384, "fms_width", 320)
    assert width.fits(2) and width.fits(4)
    assert not width.fits(3)
    assert tp.TPDim("MLP width", "intermediate_size", 384).fits(3)


def test_mixtral_expert_width_over_three_ranks():
    """The report's case: experts of width 128 over 3 ranks, which FMS
    refused inside rank 0 with a bare AssertionError."""
    config = SimpleNamespace(
        architectures=["MixtralForCausalLM"], num_attention_heads=6,
        num_key_value_heads=6, hidden_size=96, intermediate_size=128,
        num_local_experts=4, vocab_size=384)
    message = refusal(family_of(config).tp_dims(config), 3)
    assert "expert width (intermediate_size = 128)" in message
    assert message.endswith("Tensor parallel sizes that work: 1, 2.")


def test_vllm_code_pads_the_vocabulary():
    def config(vocab):
        return llama(num_attention_heads=6, num_key_value_heads=6,
                     intermediate_size=192, vocab_size=vocab)

    tp.check(tp.vllm_dims(config(49152)), 3)
    message = refusal(tp.vllm_dims(config(32000)), 3)
    assert ("vocabulary padded to a multiple of 64 (vocab_size = 32000)"
            in message)


def test_family_dimensions():
    bigcode = SimpleNamespace(architectures=["GPTBigCodeForCausalLM"],
                              n_head=6, n_embd=96, n_inner=None,
                              multi_query=True)
    dims = family_of(bigcode).tp_dims(bigcode)
    assert [(d.field, d.value) for d in dims] == [
        ("n_head", 6), ("num_key_value_heads", 1), ("n_inner", 384)]
    gpt_oss = SimpleNamespace(architectures=["GptOssForCausalLM"],
                              num_attention_heads=8, num_key_value_heads=2,
                              intermediate_size=100, hidden_size=64)
    # Its experts stay whole on every rank: only attention is split.
    assert [d.field for d in family_of(gpt_oss).tp_dims(gpt_oss)] == [
        "num_attention_heads", "num_key_value_heads"]


def test_the_platform_refuses_before_the_engine_starts(tmp_path):
    """A tiny Mixtral with experts of width 128, over 3 ranks: refused
    while vLLM's config is built, so no rank process exists."""
    import multiprocessing

    from transformers import MixtralConfig

    from vllm.engine.arg_utils import EngineArgs
    MixtralConfig(vocab_size=384, hidden_size=96, intermediate_size=128,
                  num_hidden_layers=1, num_attention_heads=6,
                  num_key_value_heads=6, num_local_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=1024,
                  architectures=["MixtralForCausalLM"]).save_pretrained(
                      tmp_path)
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"expert width \(intermediate_size"
                       r" = 128\).*sizes that work: 1, 2\."):
        EngineArgs(model=str(tmp_path), skip_tokenizer_init=True,
                   tensor_parallel_size=3).create_engine_config()
    assert multiprocessing.active_children() == before
