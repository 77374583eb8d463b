"""Tiny quantized checkpoints: a float Llama sized for weight groups of 128
under tensor parallelism over 3 ranks, and its quantized copies written by
the quantized-checkpoint writer (GPTQ int4/int8, compressed-tensors FP8, FP8
dynamic, W8A16, W4A16).

The base has hidden size 384 (6 query heads of 64, 3 key/value heads) and
intermediate size 768, so every linear's input size is a multiple of 128
on each of 3 ranks too (384 / 3 = 128, 768 / 3 = 256), and the suite's
shared tokenizer.
"""
from __future__ import annotations

from pathlib import Path

from spyre_support.paths import REPO
from spyre_support.tiny_models import BOS_ID, EOS_ID, PAD_ID, _common, _save, \
    build_tokenizer

#: The text the FP8 input scales are calibrated on (as scripts/quantize.py).
CALIBRATION = REPO / "benchmarks" / "data" / "text.txt"

#: The base's sizes.
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 384, 768, 6, 3

#: Weight standard deviation (``initializer_range``).  ``_common``'s 0.3
#: suits hidden size 96; at 384 it makes attention all but hard
#: (query-key products of standard deviation ~35) and the model chaotic:
#: 8-bit weights change a tenth of its greedy choices.  At 0.1 (a
#: projection's gain 0.1 * sqrt(384) ~ 2, attention logits of standard
#: deviation ~4) the model in float16 makes the float32 model's greedy
#: choice at 99-100% of the positions of 16 prompts x 16 tokens (3 seeds),
#: and the 8-bit integer checkpoints (dequantized) at 91-96%.
INIT_RANGE = 0.1


def build_tiny_quant_base(out_dir: Path, seed: int = 0) -> Path:
    """A float32 2-layer Llama: hidden 384, 6 query heads of 64, 3 key/value
    heads, intermediate 768, untied output head, 1024 positions."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tokenizer = build_tokenizer(seed)
    torch.manual_seed(seed)
    settings = {
        **_common(len(tokenizer), HEADS),
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "initializer_range": INIT_RANGE,
        "tie_word_embeddings": False,
    }
    assert (settings["bos_token_id"], settings["eos_token_id"],
            settings["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    config = LlamaConfig(**settings, num_key_value_heads=KV_HEADS,
                         head_dim=HIDDEN // HEADS, rms_norm_eps=1e-5)
    return _save(LlamaForCausalLM(config).eval(), tokenizer, Path(out_dir))


def build_tiny_quantized(base: Path, out_dir: Path, fmt: str, **kw) -> Path:
    """``base`` quantized to ``fmt`` (one of the writer's ``FORMATS``) in
    ``out_dir``; ``kw`` go to the writer's ``quantize`` (``group_size``,
    ``sym``, ``lm_head``, ``calibration``)."""
    from vllm.model_executor.layers.quantization.spyre_quant_writer import (
        quantize)
    kw.setdefault("calibration", str(CALIBRATION))
    return quantize(Path(base), Path(out_dir), fmt, **kw)
