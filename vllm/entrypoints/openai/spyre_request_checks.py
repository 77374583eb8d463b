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
* the guided decoding a request asks for (``response_format``,
  ``guided_*``, ``structural_tag``, a required or named tool) is checked
  against the structured-output limits (``spyre_guided_limits``): a
  schema nested too deep to be passed to the engine, or asking for more
  repetitions than the limit, is an HTTP 400 naming the field and the
  setting.

Both wrap the requests' ``to_sampling_params``, which the chat and
completion handlers call inside their ``ValueError`` -> 400 path, before
any request reaches the engine.  vLLM's ``vllm.general_plugins`` entry
point ``spyre_request_checks`` calls ``install`` in every process; the
wrappers act on the Spyre platform only.
"""
from __future__ import annotations

import functools

from vllm.engine.spyre_admission import wrap_once

#: Fields a request model does not declare but the Spyre server honours.
HONOURED_EXTRA = {"CompletionRequest": ("bad_words", )}


def install() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    from vllm.entrypoints.openai import protocol
    for request in (protocol.ChatCompletionRequest,
                    protocol.CompletionRequest):
        wrap_once(request, "to_sampling_params", _checked)


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
