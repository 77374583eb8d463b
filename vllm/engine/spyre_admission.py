"""Request admission on Spyre: a request is refused whole, before any of it
reaches the scheduler, and a refused call leaves the engine as it was.

vLLM's ``vllm.general_plugins`` entry point ``spyre_admission`` calls
``install`` in every process that builds an engine (``LLM(...)``, the
MQLLMEngine process).  It wraps two upstream V0 methods, and does nothing
unless the platform is Spyre:

* ``LLMEngine._add_processed_request`` fans a request with ``n > 1`` out
  into ``n`` sequence groups of one sample each before the scheduler sees
  any of them, so a scheduler cannot judge ``n``.  The wrapper first asks
  each Spyre scheduler's ``refuse_parallel_samples`` whether the ``n``
  samples could ever run side by side; a ``ValueError`` then reaches the
  caller (HTTP 400 online) before anything was queued.  It then gives a
  request with guided decoding its grammar as a logits processor
  (``spyre_structured_output.attach``, which refuses a bad schema, regex
  or grammar the same way), before the fan-out copies it to every
  sample.  Before either, a request naming a LoRA adapter has it
  checked and loaded (``spyre_lora_admission``), so that a bad adapter
  is refused here rather than failing a step; a prompt with images
  asking for prompt log-probabilities is refused, and one whose text
  holds more image placeholders than its images fill.
* ``LLM._validate_and_add_requests`` adds a list of prompts one by one; in
  V0 an error on the k-th leaves the first k-1 queued, and the caller's next
  ``generate`` returns their outputs.  The wrapper aborts every request the
  failed call added, then re-raises.

The online server needs no second wrapper: MQLLMEngine already aborts a
request whose ``add_request`` raised.
"""
from __future__ import annotations

from typing import Any

from vllm.engine.spyre_upstream_wraps import wrap_once
from vllm.logger import init_logger

logger = init_logger(__name__)


def install() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    from vllm.engine.llm_engine import LLMEngine
    from vllm.entrypoints.llm import LLM
    wrap_once(LLMEngine, "_add_processed_request", _refuse_before_fan_out)
    wrap_once(LLM, "_validate_and_add_requests", _add_all_or_none)


def _refuse_before_fan_out(original):

    def add_processed_request(engine, request_id: str, processed_inputs,
                              params, *args, **kwargs) -> Any:
        from vllm.sampling_params import SamplingParams
        if isinstance(params, SamplingParams) and params.n > 1 and _spyre():
            prompt_len = _decoder_prompt_len(processed_inputs)
            for scheduler in engine.scheduler:
                refuse = getattr(scheduler, "refuse_parallel_samples", None)
                if refuse is not None:
                    refuse(prompt_len, params)
        if isinstance(params, SamplingParams) and _spyre():
            _refuse_image_prompt_logprobs(processed_inputs, params)
        if _spyre():
            _refuse_stray_image_placeholders(engine, processed_inputs)
        if _spyre():
            from vllm.engine import spyre_lora_admission
            spyre_lora_admission.admit(engine, _lora_request(args, kwargs))
        if isinstance(params, SamplingParams) and _spyre():
            from vllm.engine import spyre_structured_output
            params = spyre_structured_output.attach(engine, request_id,
                                                    params)
        return original(engine, request_id, processed_inputs, params, *args,
                        **kwargs)

    return add_processed_request


def _add_all_or_none(original):

    def validate_and_add_requests(llm, *args, **kwargs) -> Any:
        if not _spyre():
            return original(llm, *args, **kwargs)
        # LLM numbers its requests with this counter, so the ids a call
        # added are exactly those it handed out.
        first = llm.request_counter.counter
        try:
            return original(llm, *args, **kwargs)
        except BaseException:
            added = [str(i) for i in range(first, llm.request_counter.counter)]
            if added:
                llm.llm_engine.abort_request(added)
                logger.debug("Withdrew %d request(s) of a refused call",
                             len(added))
            raise

    return validate_and_add_requests


def _lora_request(args: tuple, kwargs: dict):
    """``_add_processed_request``'s ``lora_request`` (after
    ``arrival_time``)."""
    if "lora_request" in kwargs:
        return kwargs["lora_request"]
    return args[1] if len(args) > 1 else None


def _refuse_image_prompt_logprobs(processed_inputs, params) -> None:
    """Prompt log-probabilities are computed on the prompt's token ids,
    which for a prompt with images hold placeholders, not the images."""
    if params.prompt_logprobs is None:
        return
    from vllm.inputs.parse import split_enc_dec_inputs
    _, decoder_inputs = split_enc_dec_inputs(processed_inputs)
    if decoder_inputs.get("type") == "multimodal":
        raise ValueError(
            f"prompt_logprobs={params.prompt_logprobs} of a prompt with "
            "images is not supported on Spyre: they would be computed on "
            "the images' placeholder tokens")


def _refuse_stray_image_placeholders(engine, processed_inputs) -> None:
    """A prompt with images whose text holds the image placeholder too
    (``<image>`` typed in a chat message): vLLM expands one placeholder
    per image, the others stay, and merging the images' features at the
    placeholders would fail inside an engine step."""
    from vllm.inputs.parse import split_enc_dec_inputs
    _, decoder_inputs = split_enc_dec_inputs(processed_inputs)
    if decoder_inputs.get("type") != "multimodal":
        return
    token = getattr(engine.model_config.hf_config, "image_token_index", None)
    ranges = decoder_inputs.get("mm_placeholders", {}).get("image", ())
    if token is None or not ranges:
        return
    features = sum(r.length if r.is_embed is None else int(r.is_embed.sum())
                   for r in ranges)
    found = list(decoder_inputs["prompt_token_ids"]).count(token)
    if found != features:
        raise ValueError(
            f"The prompt holds {found} image placeholder tokens (id "
            f"{token}) where its {len(ranges)} image(s) fill {features}: "
            "remove the placeholder from the prompt's text (vLLM inserts "
            "one for each image)")


def _decoder_prompt_len(processed_inputs) -> int:
    from vllm.inputs.parse import split_enc_dec_inputs
    _, decoder_inputs = split_enc_dec_inputs(processed_inputs)
    return len(decoder_inputs.get("prompt_token_ids") or ())


def _spyre() -> bool:
    from vllm.config.spyre import is_spyre
    return is_spyre()
