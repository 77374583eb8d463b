"""What the Spyre platform resolves from the model at start-up.

``SpyreConfig`` holds what the environment says; ``SpyreModelFacts`` holds
what the platform decides from the model itself, once, in
``check_and_update_config``: whose model code serves a decoder (FMS's or
vLLM's own, from ``--model-impl`` and the architecture) and the window its
attention slides over.  The platform stores it in
``vllm_config.additional_config["spyre_model"]`` beside the settings, so
that every engine and worker process reads the same facts; a pooling
model, whose encoders have neither choice, gets the defaults.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

#: The decoder's model code, as ``SpyreModelFacts.model_impl`` records it
#: (``spyre_model_impl`` resolves ``--model-impl`` into one of them).
FMS = "fms"
VLLM = "vllm"


@dataclass(frozen=True)
class SpyreModelFacts:
    """A decoder's model code and sliding window, resolved at start-up."""

    #: Where the facts travel in ``vllm_config.additional_config``.
    KEY: ClassVar[str] = "spyre_model"
    #: Where a speculative draft model's facts travel
    #: (``"method": "draft_model"``).
    DRAFT_KEY: ClassVar[str] = "spyre_draft_model"

    #: The decoder's model code: FMS's (``"fms"``) or vLLM's own
    #: (``"vllm"``).
    model_impl: str = FMS
    #: The sliding window of the decoder's attention (0: whole context);
    #: the Spyre attention ops apply it (vLLM's own window setting is
    #: cleared).
    sliding_window: int = 0

    def store(self, vllm_config: Any, key: str = KEY) -> None:
        extra = dict(vllm_config.additional_config or {})
        extra[key] = asdict(self)
        vllm_config.additional_config = extra

    @classmethod
    def from_vllm_config(cls, vllm_config: Any,
                         key: str = KEY) -> "SpyreModelFacts":
        """The facts the platform stored (under ``key``: the served
        model's, or the draft model's); the defaults where it stored none
        (a pooling model)."""
        extra = vllm_config.additional_config or {}
        return cls(**extra.get(key, {}))
