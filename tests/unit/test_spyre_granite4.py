"""Spyre's Granite 4 model (``spyre_granite4``) without an engine: built
by FMS's ``get_model`` from a tiny transformers checkpoint of each form
FMS's own ``granite_moe_hybrid`` lacks, its logits over a whole prompt
equal transformers'; and the family registry sends each Granite 4 form
to the model that runs it."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from spyre_support.tiny_models import build_tiny_family
from vllm.model_executor.layers.spyre_mamba import SpyreSSM, use_spyre_ssm
from vllm.model_executor.models import spyre_families as sf

FORMS = {
    "hybrid: Mamba-2, nope, experts": ("granite4_h", {}),
    "experts, rope": ("granite4", dict(experts=4)),
    "dense, nope": ("granite4", dict(positions="nope")),
}


@pytest.fixture(scope="module", params=list(FORMS))
def checkpoint(request, tmp_path_factory):
    name, options = FORMS[request.param]
    return build_tiny_family(name, tmp_path_factory.mktemp("g4"),
                             **options)


def test_logits_equal_transformers(checkpoint):
    from fms.models import get_model
    hf_config = AutoConfig.from_pretrained(checkpoint)
    assert sf.family_of(hf_config).fms_architecture == "spyre_granite4"
    model = get_model(**sf.fms_model_args(str(checkpoint), hf_config),
                      data_type=torch.float32, device_type="cpu")
    sf.family_of(hf_config).prepare(model)
    mamba = hf_config.layer_types.count("mamba")
    assert sum(isinstance(m, SpyreSSM) for m in model.modules()) == mamba
    assert use_spyre_ssm(model) == 0  # prepare gave them all
    if hf_config.tie_word_embeddings:
        assert model.head.weight is model.base_model.embedding.weight
    hf = AutoModelForCausalLM.from_pretrained(checkpoint,
                                              dtype=torch.float32).eval()
    ids = torch.randint(4, 380, (1, 45),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids).logits
        got = model.eval()(ids, position_ids=torch.arange(45)[None])
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def granite4_config(**kw):
    from transformers import GraniteMoeHybridConfig
    kw.setdefault("num_local_experts", 0)  # transformers' default is 8
    return GraniteMoeHybridConfig(
        architectures=["GraniteMoeHybridForCausalLM"],
        num_hidden_layers=kw.pop("layers", 2), **kw)


@pytest.mark.parametrize("kw, fms, hybrid", [
    (dict(layer_types=["attention"] * 2, position_embedding_type="rope"),
     "granite_moe_hybrid", False),
    (dict(layer_types=["attention"] * 2, position_embedding_type="rope",
          num_local_experts=4, num_experts_per_tok=2), "spyre_granite4",
     False),
    (dict(layer_types=["attention"] * 2, position_embedding_type="nope"),
     "spyre_granite4", False),
    (dict(layer_types=["mamba", "attention"]), "spyre_granite4", True),
])
def test_family_per_form(kw, fms, hybrid):
    family = sf.family_of(granite4_config(**kw))
    assert family.fms_architecture == fms
    assert family.hybrid is hybrid


@pytest.mark.parametrize("kw, words", [
    (dict(layer_types=["mamba"] * 2), "all 2 layers are Mamba-2 layers"),
    (dict(layer_types=["attention"] * 2, num_local_experts=4,
          num_experts_per_tok=2, hidden_act="gelu"),
     "experts with hidden_act 'gelu'"),
    (dict(layer_types=["mamba", "attention"], position_embedding_type="rope",
          rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_scaling"),
])
def test_what_spyres_model_does_not_compute_is_refused(kw, words):
    with pytest.raises(NotImplementedError) as err:
        sf.family_of(granite4_config(**kw))
    assert "GraniteMoeHybridForCausalLM" in str(err.value)
    assert words in str(err.value)


def test_positions_other_than_rope_are_none():
    """transformers applies rotary embeddings for ``rope`` only; a null
    ``position_embedding_type`` (its default) means none, as ``nope``."""
    from vllm.model_executor.models.spyre_granite4 import config_from_hf
    for kind, rope in [("rope", True), ("nope", False), (None, False)]:
        hf_config = granite4_config(layer_types=["mamba", "attention"],
                                    position_embedding_type=kind)
        assert config_from_hf(hf_config)["rope"] is rope
