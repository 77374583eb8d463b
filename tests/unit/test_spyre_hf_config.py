"""A config's null optional fields read as transformers reads them before
FMS maps the config (``spyre_hf_config``): per family, each field that
transformers allows to be null gets its meaning, FMS's mapping no longer
fails on it, and the MLP width FMS derives is the config's exactly."""
from __future__ import annotations

import json

import pytest

from vllm.model_executor.models.spyre_hf_config import (fms_config_params,
                                                        with_null_meanings)

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=128)


def _configs():
    from transformers import (GPTBigCodeConfig, GraniteConfig, LlamaConfig,
                              MistralConfig, MixtralConfig, Qwen3Config)
    return {
        "llama": LlamaConfig(num_key_value_heads=2, **COMMON),
        "granite": GraniteConfig(num_key_value_heads=2, **COMMON),
        "gpt_bigcode": GPTBigCodeConfig(vocab_size=256, n_embd=64,
                                        n_inner=256, n_layer=2, n_head=4,
                                        n_positions=128),
        "mistral": MistralConfig(num_key_value_heads=2, head_dim=16,
                                 **COMMON),
        "mixtral": MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                 **COMMON),
        "qwen3": Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON),
    }


ARCHS = {"llama": "LlamaForCausalLM", "granite": "GraniteForCausalLM",
         "gpt_bigcode": "GPTBigCodeForCausalLM",
         "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
         "qwen3": "Qwen3ForCausalLM"}

# (family, null fields, FMS parameters expected: value, or None = FMS's
# default (the key is absent)).
CASES = [
    ("llama", ["attention_bias", "mlp_bias", "tie_word_embeddings",
               "max_position_embeddings"],
     dict(attn_bias=False, mlp_bias=False, tie_heads=False,
          max_expected_seq_len=None)),
    ("granite", ["attention_bias", "mlp_bias", "tie_word_embeddings",
                 "max_position_embeddings"],
     dict(attn_bias=False, mlp_bias=False, tie_heads=False,
          max_expected_seq_len=None)),
    ("gpt_bigcode", ["n_inner", "multi_query", "tie_word_embeddings"],
     dict(hidden_grow_factor=4.0, multiquery_attn=False, tie_heads=False)),
    ("mistral", ["attention_dropout", "tie_word_embeddings",
                 "max_position_embeddings"],
     dict(p_dropout=0.0, tie_heads=False, max_expected_seq_len=None)),
    ("mixtral", ["tie_word_embeddings", "max_position_embeddings"],
     dict(tie_heads=False, max_expected_seq_len=None)),
    ("qwen3", ["attention_dropout", "tie_word_embeddings",
               "max_position_embeddings"],
     dict(p_dropout=0.0, tie_heads=False, max_expected_seq_len=None)),
]


def _folder(tmp_path, family, nulls, **changes):
    config = _configs()[family]
    config.architectures = [ARCHS[family]]
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.update(changes)
    data.update({name: None for name in nulls})
    (tmp_path / "config.json").write_text(json.dumps(data))
    return str(tmp_path)


@pytest.mark.parametrize("family, nulls, expected", CASES,
                         ids=[c[0] for c in CASES])
def test_null_fields_get_transformers_meaning(tmp_path, family, nulls,
                                              expected):
    params = fms_config_params(_folder(tmp_path, family, nulls))
    for name, value in expected.items():
        if value is None:
            assert name not in params, (name, params.get(name))
        else:
            assert params[name] == value, (name, params[name])


def test_fms_own_mapping_fails_on_a_null_n_inner(tmp_path):
    """What the module is for: FMS's entry point raises on the config
    transformers itself runs."""
    from fms.models.hf.utils import infer_model_configuration
    path = _folder(tmp_path, "gpt_bigcode", ["n_inner"])
    with pytest.raises(TypeError):
        infer_model_configuration(path, download_weights=False)


@pytest.mark.parametrize("family", list(ARCHS))
def test_the_fms_model_builds_with_every_null_field(tmp_path, family):
    """FMS builds each family (no weights) from the mapped parameters,
    with the MLP width transformers gives."""
    import torch
    from fms.models import get_model
    nulls = dict((c[0], c[1]) for c in CASES)[family]
    params = fms_config_params(_folder(tmp_path, family, nulls))
    params.pop("model_path", None)
    fixes = {"mixtral": dict(kvheads=2), "mistral": dict(multiple_of=1),
             "qwen3": dict(multiple_of=1),
             "gpt_bigcode": dict(pad_id=None)}.get(family, {})
    params.update(fixes)
    model = get_model(params.pop("architecture"), params.pop("variant"),
                      device_type="cpu", data_type=torch.float32,
                      **params)
    widths = {m.in_features for m in model.modules()
              if isinstance(m, torch.nn.Linear)} | {
                  m.out_features for m in model.modules()
                  if isinstance(m, torch.nn.Linear)}
    inner = 4 * 64 if family == "gpt_bigcode" else 128
    assert inner in widths, sorted(widths)


@pytest.mark.parametrize("hidden, inner", [(112, 230), (704, 960),
                                           (64, 128)])
def test_mlp_width_is_the_configs_exactly(tmp_path, hidden, inner):
    """int(inner / hidden * hidden) is inner - 1 for these pairs in
    floating point: the ratio given to FMS rounds back to inner."""
    path = _folder(tmp_path, "llama", [], hidden_size=hidden,
                   intermediate_size=inner, num_attention_heads=hidden // 16,
                   num_key_value_heads=hidden // 16)
    params = fms_config_params(path)
    assert int(params["hidden_grow_factor"] * hidden) == inner
    for ranks in (1, 2):
        assert int(params["hidden_grow_factor"] / ranks * hidden) == \
            inner // ranks


def test_fields_that_are_set_stay(tmp_path):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(
        _folder(tmp_path, "gpt_bigcode", [], tie_word_embeddings=True,
                multi_query=True))
    filled, names = with_null_meanings(config)
    assert names == []
    assert filled.tie_word_embeddings is True and filled.n_inner == 256
