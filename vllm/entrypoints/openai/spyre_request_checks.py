"""What a client sends to the OpenAI server on Spyre is used or refused,
never dropped, and a structured-output request too large to compile is
refused before it leaves the API server.

vLLM 0.10.1.1's request models accept any extra field and only log it
("The following fields were present in the request but ignored"); the
client gets an answer as if the field had been honoured.  On Spyre:

* ``bad_words``, a ``SamplingParams`` field that vLLM's chat request
  carries but its completion request lacks, is honoured on
  ``/v1/completions`` as on ``/v1/chat/completions``;
* any other field neither request declares is an HTTP 400 naming it (the
  OpenAI API answers an unrecognized argument the same way);
* declared fields that nothing on this server would act on are an HTTP
  400 naming them too: ``vllm_xargs`` (arguments of V1's logits
  processors), ``kv_transfer_params`` (no KV connector), a
  ``length_penalty`` without beam search, ``prompt_embeds`` (prompt
  embeddings are refused at start-up; vLLM answered a malformed one with
  HTTP 500) and a chat's ``reasoning_effort`` for a model whose chat
  template has no reasoning budget (all but gpt-oss);
* the guided decoding a request asks for (``response_format``,
  ``guided_*``, ``structural_tag``, a required or named tool) is checked
  against the structured-output limits (``spyre_guided_limits``): a
  schema nested too deep to be passed to the engine, or asking for more
  repetitions than the limit, is an HTTP 400 naming the field and the
  setting.

The checks wrap the requests' ``to_sampling_params``, which the chat and
completion handlers call inside their ``ValueError`` -> 400 path, before
any request reaches the engine; the two that need the served model or
must come before the prompt is read wrap the handlers themselves.
vLLM's ``vllm.general_plugins`` entry point ``spyre_request_checks``
calls ``install`` in every process; the wrappers act on the Spyre
platform only.
"""
from __future__ import annotations

import functools

from vllm.engine.spyre_upstream_wraps import wrap_once

#: Fields a request model does not declare but the Spyre server honours.
HONOURED_EXTRA = {"CompletionRequest": ("bad_words", )}


#: Declared fields the V0 engine on Spyre has no use for, and why.
UNUSED = {
    "vllm_xargs": "extra arguments of vLLM V1's logits processors, which "
                  "the V0 engine on Spyre does not run",
    "kv_transfer_params": "no KV transfer connector runs on Spyre "
                          "(disaggregated prefill is not supported)",
}


def install() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    from vllm.entrypoints.openai import (protocol, serving_chat,
                                         serving_completion)
    for request in (protocol.ChatCompletionRequest,
                    protocol.CompletionRequest):
        wrap_once(request, "to_sampling_params", _checked)
    wrap_once(serving_completion.OpenAIServingCompletion,
              "create_completion", _checked_handler(_completion_refusal))
    wrap_once(serving_chat.OpenAIServingChat, "create_chat_completion",
              _checked_handler(_chat_refusal))


def unused_fields(request) -> list[str]:
    """Why each declared field set on ``request`` would be ignored here,
    one message a field (empty when none is)."""
    found = [f"{name}: {why}; remove it from the request"
             for name, why in UNUSED.items() if getattr(request, name, None)]
    penalty = getattr(request, "length_penalty", 1.0)
    if penalty != 1.0 and not getattr(request, "use_beam_search", False):
        found.append(f"length_penalty={penalty} applies to beam search "
                     "only: set use_beam_search=true, or remove it")
    return found


def _completion_refusal(handler, request):
    if request.prompt_embeds is not None:
        return ("prompt_embeds: prompt embeddings are not supported on "
                "Spyre (--enable-prompt-embeds is refused at start-up); "
                "send the prompt as text or token ids")
    return None


def _chat_refusal(handler, request):
    if request.reasoning_effort is not None and not getattr(
            handler, "use_harmony", False):
        model_type = handler.model_config.hf_config.model_type
        return (f"reasoning_effort: the chat template of this model "
                f"({model_type}) has no reasoning budget, so it would be "
                "ignored (gpt-oss models use it); remove it from the "
                "request")
    return None


def _checked_handler(refusal):
    """A wrapper of a handler's ``create_*`` that answers HTTP 400 with
    ``refusal(handler, request)`` when it names one, on Spyre."""

    def make(original):

        async def create(handler, request, *args, **kwargs):
            from vllm.config.spyre import is_spyre
            if is_spyre():
                reason = refusal(handler, request)
                if reason is not None:
                    return handler.create_error_response(reason)
            return await original(handler, request, *args, **kwargs)

        return create

    return make


def _checked(original):

    def to_sampling_params(request, *args, **kwargs):
        from vllm.config.spyre import is_spyre
        if not is_spyre():
            return original(request, *args, **kwargs)
        extra = dict(request.model_extra or {})
        honoured = {
            name: extra.pop(name)
            for name in HONOURED_EXTRA.get(type(request).__name__, ())
            if name in extra
        }
        if extra:
            raise ValueError(
                f"{', '.join(sorted(extra))}: not a field of "
                f"{_endpoint(request)} on this server; remove "
                f"{'it' if len(extra) == 1 else 'them'} from the request")
        unused = unused_fields(request)
        if unused:
            raise ValueError("; ".join(unused))
        params = original(request, *args, **kwargs)
        if "bad_words" in honoured:
            params.bad_words = _word_list(honoured["bad_words"])
        from vllm.engine import spyre_guided_limits
        try:
            spyre_guided_limits.check(params.guided_decoding, _limits())
        except ValueError as e:
            raise ValueError(f"Guided decoding: {e}") from e
        return params

    return to_sampling_params


def _endpoint(request) -> str:
    return ("/v1/completions" if type(request).__name__ == "CompletionRequest"
            else "/v1/chat/completions")


def _word_list(value) -> list[str]:
    if not (isinstance(value, list)
            and all(isinstance(w, str) for w in value)):
        raise ValueError(
            f"bad_words must be a list of strings, not {value!r}")
    return value


@functools.cache
def _limits():
    """The structured-output limits, from the server's settings."""
    from vllm.config.spyre import SpyreConfig
    from vllm.engine.spyre_guided_limits import GuidedLimits
    return GuidedLimits.from_config(SpyreConfig.from_env())
