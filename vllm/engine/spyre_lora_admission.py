"""A request's LoRA adapter is checked and loaded before the request is
queued (``spyre_admission`` calls ``admit``).

vLLM's V0 engine loads a request's adapter inside the step that first runs
it, on the workers: an adapter that cannot load there (a missing or
corrupt folder, a rank above ``--max-lora-rank``, target modules the
model lacks, an adapter trained for another base model) fails that step
and, with it, every request in the batch and the engine.  On Spyre the
engine loads each new adapter (``LLMEngine.add_lora``, on every rank)
when its first request arrives, so a bad one is refused with a
``ValueError`` naming the adapter and the problem (HTTP 400 online) and
nothing else is touched.  The workers' load checks what vLLM checks
(rank, target modules, files) and what Spyre adds (``spyre_lora``: a
local folder, matrices that fit the base model).

An adapter that passed is not checked again while its folder stays the
same.
"""
from __future__ import annotations

from typing import Any, Optional

from vllm.logger import init_logger

logger = init_logger(__name__)

_CHECKED = "_spyre_loras_checked"


def admit(engine: Any, lora_request: Optional[Any]) -> None:
    """Checks and loads ``lora_request``'s adapter on ``engine`` (an
    ``LLMEngine``) unless it passed before; a ``ValueError`` refuses it."""
    if lora_request is None or engine.lora_config is None:
        return  # without --enable-lora, upstream refuses the request
    checked: dict = engine.__dict__.setdefault(_CHECKED, {})
    lora_id, path = lora_request.lora_int_id, lora_request.lora_path
    if checked.get(lora_id) == path:
        return
    name = lora_request.lora_name
    try:
        engine.add_lora(lora_request)
    except Exception as e:
        try:
            engine.remove_lora(lora_id)
        except Exception:  # it was not added
            pass
        raise ValueError(
            f"LoRA adapter {name!r} cannot be served: {e}") from e
    checked[lora_id] = path
    logger.info("LoRA adapter %r (id %d) loaded from %s", name, lora_id,
                path)
