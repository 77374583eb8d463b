"""``scripts/benchmark_checkpoints.py`` on a small shape: a bfloat16
Hugging Face folder in several shards with their index, every tensor of
the model's class and nothing else, the default model's tokenizer, and a
quantized form written beside it through the quantization writer."""
from __future__ import annotations

import json

import pytest
import torch

import benchmark_checkpoints as bc  # scripts/ (pytest's pythonpath)

SMALL = dict(bc.SHAPES["granite-3.3-2b"], hidden_size=128,
             intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def written(tmp_path, monkeypatch, smollm2):
    monkeypatch.setitem(bc.SHAPES, "small", SMALL)
    monkeypatch.setattr(bc, "SHARD_BYTES", 4 * 2**20)  # several shards
    return bc.write_bf16("small", tmp_path)


def test_writes_a_sharded_bf16_folder(written):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm.model_executor.models.spyre_dtypes import stored_dtypes
    assert written.name == "small-bf16"
    index = json.loads((written / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 1
    names = set()
    for f in files:
        with safe_open(str(written / f), framework="pt") as st:
            names |= set(st.keys())
    assert names == set(index["weight_map"])
    assert stored_dtypes(str(written)) == {torch.bfloat16}
    config = AutoConfig.from_pretrained(written)
    assert config.architectures == ["GraniteForCausalLM"]
    assert config.vocab_size == bc.VOCAB and config.tie_word_embeddings
    assert config.embedding_multiplier == 12.0
    model, info = AutoModelForCausalLM.from_pretrained(
        written, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (written / "tokenizer.json").exists()
    # Written once: a second call keeps the folder.
    stamp = (written / "config.json").stat().st_mtime_ns
    assert bc.write_bf16("small", written.parent) == written
    assert (written / "config.json").stat().st_mtime_ns == stamp


def test_quantized_form_beside_it(written):
    folder = bc.write_quantized(written, "gptq-int8")
    assert folder == written.with_name("small-gptq-int8")
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["bits"] == 8
    assert config["quantization_config"]["lm_head"] is True


def test_fp32_form_beside_it(written):
    """Every tensor the bf16 folder's, widened exactly; float32 in the
    config and the index's size."""
    from safetensors.torch import load_file

    from vllm.model_executor.models.spyre_dtypes import stored_dtypes
    folder = bc.write_fp32(written)
    assert folder == written.with_name("small-fp32")
    assert stored_dtypes(str(folder)) == {torch.float32}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    source = json.loads(
        (written / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == source["weight_map"]
    assert index["metadata"]["total_size"] == \
        2 * source["metadata"]["total_size"]
    for file in set(source["weight_map"].values()):
        wide, narrow = (load_file(str(f / file)) for f in (folder, written))
        assert wide.keys() == narrow.keys()
        for name, t in narrow.items():
            assert wide[name].dtype == torch.float32
            assert torch.equal(wide[name], t.float())
    config = json.loads((folder / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    assert (folder / "tokenizer.json").exists()
