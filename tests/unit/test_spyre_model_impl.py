"""Which model code serves a decoder (``spyre_model_impl.resolve``):
``--model-impl auto`` takes FMS where FMS has the architecture and vLLM's
model code otherwise; ``vllm`` forces vLLM's; anything else is refused
with the supported lists."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.model_executor.models.spyre_families import FAMILIES
from vllm.model_executor.models.spyre_model_impl import (
    FMS, VLLM, VLLM_ARCHITECTURES, VLLM_IMAGE_ARCHITECTURES, resolve)


def config(*archs: str, model_type: str = "x"):
    return SimpleNamespace(architectures=list(archs), model_type=model_type)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_auto_takes_fms_where_it_has_the_architecture(arch):
    assert resolve("auto", config(arch)) == (FMS, arch)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Phi3ForCausalLM"])
def test_auto_takes_vllm_where_fms_lacks_it(arch):
    assert arch not in FAMILIES
    assert resolve("auto", config(arch)) == (VLLM, arch)


@pytest.mark.parametrize("arch", VLLM_ARCHITECTURES +
                         VLLM_IMAGE_ARCHITECTURES)
def test_vllm_forces_vllm_model_code(arch):
    assert resolve("vllm", config(arch)) == (VLLM, arch)


def test_the_enum_value_is_read():
    from vllm.config import ModelImpl
    assert resolve(ModelImpl.VLLM, config("LlamaForCausalLM"))[0] == VLLM
    assert resolve(ModelImpl.AUTO, config("LlamaForCausalLM"))[0] == FMS


def test_an_architecture_neither_runs_lists_both():
    with pytest.raises(ValueError) as info:
        resolve("auto", config("GPT2LMHeadModel"))
    text = str(info.value)
    assert "GPT2LMHeadModel" in text
    assert "LlamaForCausalLM" in text and "(FMS model code)" in text
    assert "Qwen2ForCausalLM" in text and "Phi3ForCausalLM" in text
    assert "LlavaNextForConditionalGeneration" in text


@pytest.mark.parametrize("arch", VLLM_IMAGE_ARCHITECTURES)
def test_auto_takes_vllm_for_images(arch):
    assert resolve("auto", config(arch)) == (VLLM, arch)


def test_an_fms_only_architecture_is_refused_under_vllm():
    with pytest.raises(ValueError, match="GPTBigCodeForCausalLM.*"
                       "--model-impl vllm.*Qwen2ForCausalLM"):
        resolve("vllm", config("GPTBigCodeForCausalLM"))


def test_a_config_without_architectures_names_its_type():
    with pytest.raises(ValueError, match="model_type 'foo'"):
        resolve("auto", config(model_type="foo"))


def test_transformers_backend_is_refused():
    with pytest.raises(NotImplementedError, match="--model-impl transformers"):
        resolve("transformers", config("LlamaForCausalLM"))


def test_the_platform_records_the_choice_and_refuses_the_card():
    """``SpyrePlatform`` keeps the choice in the Spyre settings every
    process reads; vLLM's model code is refused on the card (sendnn),
    where its attention, run outside the graphs, would not be."""
    from vllm.platforms import spyre
    from vllm.config.spyre import SpyreConfig
    model = SimpleNamespace(model_impl="auto", quantization=None,
                            hf_config=config("Qwen2ForCausalLM"))
    cpu = SpyreConfig(dynamo_backend="inductor", warmup_shapes=())
    assert spyre._choose_model_impl(model, cpu) == VLLM
    model.hf_config = config("LlamaForCausalLM")
    assert spyre._choose_model_impl(model, cpu) == FMS
    card = SpyreConfig(dynamo_backend="sendnn", warmup_shapes=())
    assert spyre._choose_model_impl(model, card) == FMS
    model.model_impl = "vllm"
    with pytest.raises(NotImplementedError, match="not yet on the card"):
        spyre._choose_model_impl(model, card)


def test_quantized_checkpoints_take_vllm_model_code():
    """A quantized checkpoint (``spyre_quant``) runs on vLLM's model code,
    whose layers load its codes and scales, under ``auto`` too; an
    architecture vLLM's code does not run here is refused, and so is the
    card."""
    from vllm.platforms import spyre
    from vllm.config.spyre import SpyreConfig
    model = SimpleNamespace(model_impl="auto", quantization="spyre",
                            hf_config=config("LlamaForCausalLM"))
    cpu = SpyreConfig(dynamo_backend="inductor", warmup_shapes=())
    assert spyre._choose_model_impl(model, cpu) == VLLM
    assert resolve("auto", config("LlamaForCausalLM"), True) == (
        VLLM, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="Quantized checkpoints of "
                       "architecture GPTBigCodeForCausalLM"):
        resolve("auto", config("GPTBigCodeForCausalLM"), True)
    card = SpyreConfig(dynamo_backend="sendnn", warmup_shapes=())
    with pytest.raises(NotImplementedError, match="Quantized checkpoints"):
        spyre._choose_model_impl(model, card)


def test_the_facts_reach_the_workers_beside_the_settings():
    """The platform stores the model code and window it resolved beside
    the settings; every process reads them back from the vLLM config
    (after a JSON round trip too); a config without them (a pooling
    model) reads the defaults."""
    import json

    from vllm.config.spyre_model_facts import SpyreModelFacts
    vllm_config = SimpleNamespace(additional_config={"spyre": {"x": 1}})
    facts = SpyreModelFacts(model_impl=VLLM, sliding_window=4096)
    facts.store(vllm_config)
    assert vllm_config.additional_config["spyre"] == {"x": 1}
    vllm_config.additional_config = json.loads(
        json.dumps(vllm_config.additional_config))
    assert SpyreModelFacts.from_vllm_config(vllm_config) == facts
    none = SimpleNamespace(additional_config=None)
    assert SpyreModelFacts.from_vllm_config(none) == SpyreModelFacts(FMS, 0)
