"""Tiny random LoRA adapters written with PEFT, and transformers running
each one merged into its base model: the reference of the LoRA tests.

``build_adapter`` writes an adapter as PEFT saves one (``save_pretrained``:
``adapter_config.json`` and ``adapter_model.safetensors``, with the base
model's tokenizer beside them) with random A
and B matrices (PEFT starts B at zero, which would change nothing), over
the projections ``targets`` names.  ``MergedReference`` loads the base
model, applies the adapter with PEFT and merges it (``merge_and_unload``),
then generates greedily as ``HFReference`` does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from spyre_support.reference import HFReference

#: Every projection of a Llama-like decoder layer.
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                   "up_proj", "down_proj")


def build_adapter(base: Path, out_dir: Path, seed: int, rank: int = 8,
                  alpha: Optional[int] = None,
                  targets=ALL_PROJECTIONS, scale: float = 0.5,
                  with_embedding_layers: bool = False) -> Path:
    """A LoRA adapter of ``base`` with random weights (``scale`` their
    standard deviation), rank ``rank``, ``lora_alpha`` ``alpha`` (twice
    the rank unless given), over ``targets`` (``embed_tokens`` and
    ``lm_head`` among them adapt the token embedding and the output head;
    ``with_embedding_layers``: the base model's embedding and head saved
    beside, as PEFT does by default when it adapts them)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank,
                        target_modules=list(targets), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out_dir,
                               save_embedding_layers=with_embedding_layers)
    # The base model's tokenizer beside the adapter, as adapters are often
    # shipped: vLLM looks for one there first.
    AutoTokenizer.from_pretrained(base).save_pretrained(out_dir)
    return out_dir


class MergedReference(HFReference):
    """``HFReference`` over ``base`` with the adapter at ``adapter`` merged
    into its weights (None: the base model alone)."""

    def __init__(self, base: Path, adapter: Optional[Path]) -> None:
        super().__init__(base)
        if adapter is not None:
            from peft import PeftModel
            self.model = PeftModel.from_pretrained(
                self.model, adapter).merge_and_unload().eval()


def write_random_adapter(base: Path, out_dir: Path, seed: int, rank: int,
                         targets=ALL_PROJECTIONS, scale: float = 0.02,
                         dtype: str = "float32") -> Path:
    """An adapter in PEFT's layout over every ``targets`` projection of
    ``base``, with random A and B, written straight from the base
    checkpoint's safetensors headers (its weights are never loaded), with
    the base model's tokenizer beside it: for
    the benchmarks at realistic size, where building the model in
    transformers to let PEFT save an adapter would take the model's
    memory twice over."""
    import json

    import torch
    from safetensors.torch import save_file

    from vllm.lora.spyre_lora import tensor_shapes
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, shape in tensor_shapes(str(base)).items():
        module = key.removesuffix(".weight")
        if key == module or module.split(".")[-1] not in targets:
            continue
        out, inp = shape
        prefix = "base_model.model." + module
        tensors[prefix + ".lora_A.weight"] = (
            torch.randn(rank, inp, generator=gen) * scale).to(
                getattr(torch, dtype))
        tensors[prefix + ".lora_B.weight"] = (
            torch.randn(out, rank, generator=gen) * scale).to(
                getattr(torch, dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "adapter_model.safetensors")
    (out_dir / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=rank,
        lora_alpha=2 * rank, target_modules=sorted(targets),
        lora_dropout=0.0, bias="none", fan_in_fan_out=False,
        base_model_name_or_path=str(base)), indent=1))
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(base).save_pretrained(out_dir)
    return out_dir
