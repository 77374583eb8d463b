"""Checkpoints whose config leaves optional fields null, as transformers
allows, serve with transformers' meaning of each (``spyre_hf_config``):
per family a tiny checkpoint with every such field it has set null
(GPT-BigCode's ``n_inner`` among them, which FMS's own mapping fails on),
and a Llama whose MLP width FMS's ratio would round one unit short, each
generates transformers' greedy ids under static batching."""
from __future__ import annotations

import json

import pytest
import torch

from spyre_support.engines import greedy_requests, spyre_llm
from spyre_support.envs import spyre_env
from spyre_support.reference import HFReference
from spyre_support.tiny_models import build_tiny_family

ONE_SHAPE = spyre_env("eager", [64], [8], [2])

#: Fields transformers allows to be null, with the value null means there;
#: a tiny checkpoint holding that value gets the field null.
NULLABLE = {"tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "attention_dropout": 0.0,
            "multi_query": False}
#: Fields whose null transformers reads as "unbounded" (rotary caches).
UNBOUNDED = ("max_position_embeddings", )
#: Family -> fields its own config class fills when null (GPT-OSS: the
#: head size hidden / heads, and alternating sliding and full layers,
#: which the tiny checkpoint has), set null too; and the fields of
#: UNBOUNDED it cannot load without (GPT-OSS's YaRN checks the ratio of
#: max_position_embeddings to its original length).
OWN_NULLS = {"gpt_oss": ("head_dim", "layer_types")}
KEPT = {"gpt_oss": ("max_position_embeddings", )}

#: Family -> the options of its tiny checkpoint.
FAMILIES = {"llama": {}, "granite": {}, "gpt_bigcode": {"n_inner": None},
            "mistral": {}, "mixtral": {}, "qwen3": {}, "gpt_oss": {}}


def _requests():
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(4, 380, (n, ), generator=gen).tolist(), 8)
            for n in (5, 30)]


def _nulled(path, family):
    """Sets null every field of NULLABLE that holds its null meaning, every
    field of UNBOUNDED but the family's KEPT, and the family's OWN_NULLS;
    returns the names."""
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    names = [n for n, v in NULLABLE.items()
             if n in config and config[n] == v]
    names += [n for n in UNBOUNDED
              if n in config and n not in KEPT.get(family, ())]
    names += OWN_NULLS.get(family, [])
    config.update({n: None for n in names})
    config_path.write_text(json.dumps(config))
    return names


@pytest.mark.parametrize("family", list(FAMILIES))
def test_null_fields_serve_as_transformers(tmp_path, family):
    path = build_tiny_family(family, tmp_path / family, **FAMILIES[family])
    names = _nulled(path, family)
    config = json.loads((path / "config.json").read_text())
    if family == "gpt_bigcode":  # tied, multi-query: only n_inner is null
        names.append("n_inner")
    assert names and all(config[n] is None for n in names)
    _check(path)


def _check(path) -> None:
    """Static batching's greedy ids equal transformers'."""
    requests = _requests()
    hf = HFReference(path)
    expected = [hf.greedy(p, m)[0] for p, m in requests]
    del hf
    with spyre_llm(path, ONE_SHAPE) as llm:
        assert greedy_requests(llm, requests) == expected


def test_mlp_width_that_floating_point_rounds_short(tmp_path):
    """hidden 112, MLP 230: int(230 / 112 * 112) is 229."""
    assert int(230 / 112 * 112) == 229
    path = build_tiny_family("llama", tmp_path / "llama", heads=7,
                             kv_heads=7, intermediate=230)
    _check(path)
