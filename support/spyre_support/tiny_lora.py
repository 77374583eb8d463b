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
                  targets=ALL_PROJECTIONS, scale: float = 0.5) -> Path:
    """A LoRA adapter of ``base`` with random weights (``scale`` their
    standard deviation), rank ``rank``, ``lora_alpha`` ``alpha`` (twice
    the rank unless given), over ``targets``."""
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
    peft_model.save_pretrained(out_dir)
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
