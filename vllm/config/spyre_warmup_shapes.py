"""Warm-up shapes: the compiled serving shapes of static batching and
pooling models, and their parsing from the ``VLLM_SPYRE_WARMUP_*`` lists.

``SpyreConfig.from_env`` (``vllm.config.spyre``) reads the variables and builds
its shapes here; the schedulers, runners and memory check take
``WarmupShape`` values.  Errors name the variable, the value and the rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

#: Every warm-up prompt length is a multiple of this many tokens.
PROMPT_LEN_MULTIPLE = 64


@dataclass(frozen=True, order=True)
class WarmupShape:
    """One compiled serving shape: a batch of ``batch_size`` rows, each with a
    prompt padded to ``prompt_len`` tokens and up to ``new_tokens`` outputs."""

    prompt_len: int
    new_tokens: int
    batch_size: int

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def cost(self) -> tuple[int, int, int, int]:
        """Ordering key, cheapest first: the padded prompt tokens a full
        batch prefills, then the attention span, then the rest (a batch
        stops decoding when its rows are done, so new_tokens costs nothing
        unless used)."""
        return (self.batch_size * self.prompt_len, self.prompt_len,
                self.new_tokens, self.batch_size)

    def __str__(self) -> str:
        return (f"(prompt_len={self.prompt_len}, "
                f"new_tokens={self.new_tokens}, batch_size={self.batch_size})")


def parse_int_list(name: str, raw: str) -> list[int]:
    values = []
    for item in raw.split(","):
        item = item.strip()
        try:
            value = int(item)
        except ValueError:
            raise ValueError(
                f"{name}={raw!r} is invalid: {item!r} is not an integer; "
                "give a comma-separated list of positive integers."
            ) from None
        if value <= 0:
            raise ValueError(
                f"{name}={raw!r} is invalid: {value} is not a positive "
                "integer.")
        values.append(value)
    return values


def parse_warmup_shapes(prompt_lens: str, new_tokens: str,
                        batch_sizes: str) -> tuple[WarmupShape, ...]:
    """Build the warm-up shapes from the three comma lists."""
    return _shapes_from_lists({
        "VLLM_SPYRE_WARMUP_PROMPT_LENS": parse_int_list(
            "VLLM_SPYRE_WARMUP_PROMPT_LENS", prompt_lens),
        "VLLM_SPYRE_WARMUP_NEW_TOKENS": parse_int_list(
            "VLLM_SPYRE_WARMUP_NEW_TOKENS", new_tokens),
        "VLLM_SPYRE_WARMUP_BATCH_SIZES": parse_int_list(
            "VLLM_SPYRE_WARMUP_BATCH_SIZES", batch_sizes),
    }, prompt_lens)


def parse_pooling_shapes(prompt_lens: str,
                         batch_sizes: str) -> tuple[WarmupShape, ...]:
    """The shapes of a pooling model: one per (prompt length, batch size)
    pair of the two comma lists, generating nothing (``new_tokens=0``)."""
    return _shapes_from_lists({
        "VLLM_SPYRE_WARMUP_PROMPT_LENS": parse_int_list(
            "VLLM_SPYRE_WARMUP_PROMPT_LENS", prompt_lens),
        "VLLM_SPYRE_WARMUP_BATCH_SIZES": parse_int_list(
            "VLLM_SPYRE_WARMUP_BATCH_SIZES", batch_sizes),
    }, prompt_lens)


def _shapes_from_lists(lists: Mapping[str, list[int]],
                       prompt_lens: str) -> tuple[WarmupShape, ...]:
    """Shapes from equally long lists of prompt lengths (``prompt_lens``
    as given), batch sizes and, where given, new tokens (0 when not)."""
    lengths = {name: len(v) for name, v in lists.items()}
    if len(set(lengths.values())) != 1:
        listed = ", ".join(f"{n} has {k}" for n, k in lengths.items())
        raise ValueError(
            "The warm-up shape lists must have equal length (one entry per "
            f"shape): {listed}.")
    for p in lists["VLLM_SPYRE_WARMUP_PROMPT_LENS"]:
        if p % PROMPT_LEN_MULTIPLE:
            raise ValueError(
                f"VLLM_SPYRE_WARMUP_PROMPT_LENS={prompt_lens!r} is invalid: "
                f"{p} is not a multiple of {PROMPT_LEN_MULTIPLE}.")
    count = len(lists["VLLM_SPYRE_WARMUP_PROMPT_LENS"])
    shapes = [
        WarmupShape(p, n, b) for p, n, b in zip(
            lists["VLLM_SPYRE_WARMUP_PROMPT_LENS"],
            lists.get("VLLM_SPYRE_WARMUP_NEW_TOKENS", [0] * count),
            lists["VLLM_SPYRE_WARMUP_BATCH_SIZES"])
    ]
    # Duplicates would only compile the same graphs twice.
    return tuple(sorted(set(shapes)))
