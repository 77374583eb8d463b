"""Which model code serves a decoder on Spyre: FMS's or vLLM's own.

vLLM's ``--model-impl`` keeps its meaning on Spyre:

* ``auto`` (the default): FMS's model where FMS has the architecture
  (``spyre_families.FAMILIES``), else vLLM's own model class;
* ``vllm``: vLLM's own model class (``LlamaForCausalLM``,
  ``Qwen2ForCausalLM``, ...), loaded by vLLM's weight loader, attending
  through the Spyre attention backend (``spyre_attn``);
* ``transformers`` (vLLM's Transformers backend): not supported on Spyre.

vLLM's model classes reach Spyre for the architectures of
``VLLM_ARCHITECTURES``: decoders whose attention the Spyre backend runs
(causal self-attention, grouped or multi-query, no ALiBi, soft cap or
attention sinks), each tested from a tiny random checkpoint, and for the
vision-language models of ``VLLM_IMAGE_ARCHITECTURES``.  The platform
calls ``resolve`` at start-up, so any other architecture is refused before
anything is loaded.
"""
from __future__ import annotations

# The implementations, as ``SpyreModelFacts.model_impl`` records them.
from vllm.config.spyre_model_facts import FMS, VLLM
from vllm.model_executor.models.spyre_families import FAMILIES

#: Architectures whose vLLM model class runs on Spyre.
VLLM_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "GraniteForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
#: Vision-language models (images in, text out) whose vLLM model class
#: runs on Spyre: its language model is one of the decoders above, its
#: vision tower runs eagerly (``spyre_image_inputs``).
VLLM_IMAGE_ARCHITECTURES: tuple[str, ...] = (
    "LlavaNextForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
)


def flag_value(model_impl) -> str:
    """``--model-impl`` as the user wrote it (vLLM's ``ModelImpl`` or its
    string)."""
    return str(getattr(model_impl, "value", model_impl))


def resolve(model_impl, hf_config,
            quantized: bool = False) -> tuple[str, str]:
    """(``FMS`` or ``VLLM``, the architecture) for vLLM's ``--model-impl``
    value and a Hugging Face config; a clear error for an implementation
    or an architecture Spyre does not run.  A ``quantized`` checkpoint
    (GPTQ, compressed-tensors: ``spyre_quant``) runs on vLLM's model code,
    whose layers load its codes and scales, under ``auto`` too."""
    value = flag_value(model_impl)
    archs = list(getattr(hf_config, "architectures", None) or [])
    if value == "transformers":
        raise NotImplementedError(
            "--model-impl transformers (vLLM's Transformers backend) is not "
            "supported on Spyre; use --model-impl auto (FMS where it has the "
            "architecture, else vLLM's own model code) or --model-impl vllm.")
    if value not in ("auto", VLLM):
        raise ValueError(f"Unknown --model-impl {value!r}: auto, vllm and "
                         "transformers are vLLM's values")
    if value == "auto" and not quantized:
        for arch in archs:
            if arch in FAMILIES:
                return FMS, arch
    for arch in archs:
        if arch in VLLM_ARCHITECTURES + VLLM_IMAGE_ARCHITECTURES:
            return VLLM, arch
    named = ", ".join(archs) or f"model_type {hf_config.model_type!r}"
    if quantized:
        raise ValueError(
            f"Quantized checkpoints of architecture {named} are not "
            "supported on Spyre: they run on vLLM's model code, which "
            f"Spyre runs for {', '.join(VLLM_ARCHITECTURES)}.")
    if value == VLLM:
        raise ValueError(
            f"Architecture {named} is not supported on Spyre with "
            f"--model-impl vllm. Supported architectures: "
            f"{', '.join(VLLM_ARCHITECTURES + VLLM_IMAGE_ARCHITECTURES)}.")
    raise ValueError(
        f"Architecture {named} is not supported on Spyre. Supported "
        f"architectures: {', '.join(FAMILIES)} (FMS model code); "
        f"{', '.join(a for a in VLLM_ARCHITECTURES if a not in FAMILIES)} "
        "(vLLM's model code, --model-impl auto or vllm); "
        f"{', '.join(VLLM_IMAGE_ARCHITECTURES)} (images, vLLM's model "
        "code).")
