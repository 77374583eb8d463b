"""The dimensions tensor parallelism splits, and the sizes that split them.

Each rank of a tensor-parallel decoder holds a slice of its attention
heads, of its MLP and, in some models, of its experts or vocabulary.  A
dimension that does not divide among the ranks is found by FMS (or by
vLLM's layers) only inside each rank, after every rank has started, as a
bare ``AssertionError``.  ``check`` refuses such a configuration at
start-up instead, before any rank starts, naming each dimension that does
not divide, its value, and the tensor-parallel sizes that work.

The dimensions of a family are given by its entry in the family table
(``DecoderFamily.tp_dims``, built from the helpers here); on vLLM's own
model code, ``vllm_dims``.  The rules are those of the code that splits:

* attention heads: ``heads % N == 0``;
* key/value heads: ``kv % N == 0``, or ``N % kv == 0`` (each rank then holds
  one key/value head, copied to ``N / kv`` ranks);
* an MLP width in FMS: FMS rebuilds the width from its ratio to the hidden
  size, ``int(W / hidden * hidden)``, and gives each rank
  ``int(W / hidden / N * hidden)`` rows: both must come back to ``W``
  (``W % N == 0`` is not enough for every ``N``);
* an expert's width, a sharded embedding's width or vocabulary, vLLM's
  MLP width: ``% N == 0``; vLLM pads the vocabulary to a multiple of 64
  first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: How vLLM's vocabulary-parallel embedding pads the vocabulary.
VOCAB_PADDING = 64


@dataclass(frozen=True)
class TPDim:
    """One dimension split over the ranks."""

    label: str
    field: str
    value: int
    #: "divides", "kv" (divides or is divided) or "fms_width".
    rule: str = "divides"
    #: The hidden size an FMS width is a ratio of.
    hidden: int = 0

    def fits(self, n: int) -> bool:
        if n == 1:  # one rank splits nothing
            return True
        if self.rule == "kv":
            return (self.value % n == 0 if self.value >= n else
                    n % self.value == 0)
        if self.rule == "fms_width":
            ratio = self.value / self.hidden
            return (int(ratio * self.hidden) == self.value
                    and int(ratio / n * self.hidden) * n == self.value)
        return self.value % n == 0

    def describe(self) -> str:
        if self.rule == "kv":
            rule = "a multiple or a divisor of the size"
        elif self.rule == "fms_width":
            rule = (f"a multiple of the size that FMS's split of it (by "
                    f"its ratio to the hidden size {self.hidden}) keeps "
                    "whole")
        else:
            rule = "a multiple of the size"
        return f"{self.label} ({self.field} = {self.value}) must be {rule}"


def attention(hf_config, heads_field: str = "num_attention_heads",
              kv_heads=None) -> list[TPDim]:
    heads = getattr(hf_config, heads_field)
    if kv_heads is None:
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return [TPDim("attention heads", heads_field, heads),
            TPDim("key/value heads", "num_key_value_heads", kv_heads, "kv")]


def fms_mlp(field: str) -> Callable[[Any], list[TPDim]]:
    """Attention heads and FMS's MLP of width ``hf_config.<field>``."""

    def dims(hf_config) -> list[TPDim]:
        return attention(hf_config) + [
            TPDim("MLP width", field, getattr(hf_config, field),
                  "fms_width", hf_config.hidden_size)]

    return dims


def experts(hf_config) -> list[TPDim]:
    """An expert's width, split on every rank (the experts are not)."""
    if not getattr(hf_config, "num_local_experts", 0):
        return []
    return [TPDim("expert width", "intermediate_size",
                  hf_config.intermediate_size)]


def granite4(hf_config) -> list[TPDim]:
    return fms_mlp("shared_intermediate_size")(hf_config) + experts(
        hf_config)


def mixtral(hf_config) -> list[TPDim]:
    """Attention, experts, and FMS's Mixtral splits its embedding's width
    and its head's vocabulary too."""
    return attention(hf_config) + experts(hf_config) + [
        TPDim("embedding width", "hidden_size", hf_config.hidden_size),
        TPDim("vocabulary", "vocab_size", hf_config.vocab_size)]


def gpt_bigcode(hf_config) -> list[TPDim]:
    heads = hf_config.n_head
    width = getattr(hf_config, "n_inner", None) or 4 * hf_config.n_embd
    return attention(hf_config, "n_head",
                     1 if getattr(hf_config, "multi_query", True) else heads
                     ) + [TPDim("MLP width", "n_inner", width, "fms_width",
                                hf_config.n_embd)]


def vllm_dims(hf_text_config) -> list[TPDim]:
    """vLLM's own dense decoders: attention, the MLP, the vocabulary as
    vLLM pads it."""
    vocab = hf_text_config.vocab_size
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    return attention(hf_text_config) + [
        TPDim("MLP width", "intermediate_size",
              hf_text_config.intermediate_size),
        TPDim(f"vocabulary padded to a multiple of {VOCAB_PADDING}",
              "vocab_size", padded)]


def sizes_that_work(dims: list[TPDim]) -> list[int]:
    """Every tensor-parallel size (a divisor of the attention heads) that
    splits all of ``dims``."""
    heads = dims[0].value
    return [n for n in range(1, heads + 1)
            if heads % n == 0 and all(d.fits(n) for d in dims)]


def check(dims: list[TPDim], size: int) -> None:
    """A ``ValueError`` naming every dimension of ``dims`` that ``size``
    ranks cannot split, and the sizes that can."""
    if size == 1:
        return
    failing = [d for d in dims if not d.fits(size)]
    if failing:
        raise ValueError(
            f"Tensor parallel size {size} cannot split this model: "
            + "; ".join(d.describe() for d in failing)
            + ". Tensor parallel sizes that work: "
            + ", ".join(map(str, sizes_that_work(dims))) + ".")
