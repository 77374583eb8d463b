"""Streams of parallel samples (``n > 1``).

vLLM's V0 engine streams a request with ``n > 1`` as outputs assembled
from its samples, and three of its corner cases break the OpenAI server's
streams: tokens are lost, and when the client asked for log-probabilities
(the completion's ``logprobs``, the chat's ``logprobs: true``) the server
answers with an error event, "Did not output logprobs", and the rest of
the answer is lost.

* ``ParallelSampleSequenceGroup.maybe_assemble_group`` gives the request
  an output for each sample whose group is processed first among those
  not finished, so in a step where a sample ends, the next sample gives a
  second output of the same step.  With the engine's reused output
  objects (``use_cached_outputs``, on in the OpenAI server's engine) the
  second overwrote the first, which carried the step's tokens: streamed
  samples lost tokens.  The wrapper builds a parallel request's outputs
  afresh and drops an output that carries no new token and does not end
  the request; of several final outputs only the first goes out (samples
  ending in the same step gave a second, empty one).
* ``RequestOutput.from_seq_group`` gives a sample that had no new token
  in a step no log-probabilities at all, where the server expects a
  list.  The wrapper gives it the empty list.

``install`` is a ``vllm.general_plugins`` entry point; the wrappers do
nothing unless the platform is Spyre.
"""
from __future__ import annotations

from typing import Any

from vllm.engine.spyre_upstream_wraps import wrap_once


def install() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    from vllm.outputs import RequestOutput
    from vllm.sequence import ParallelSampleSequenceGroup
    wrap_once(ParallelSampleSequenceGroup, "maybe_assemble_group",
              _one_final_output)
    wrap_once(RequestOutput, "from_seq_group", _whole_outputs)


def _one_final_output(original):

    def maybe_assemble_group(group, seq_group) -> Any:
        assembled = original(group, seq_group)
        if (assembled is None or not group.streaming
                or not assembled.is_finished() or not _spyre()):
            return assembled
        if getattr(group, "_spyre_final_given", False):
            return None
        group._spyre_final_given = True
        return assembled

    return maybe_assemble_group


def _whole_outputs(original):
    """``original`` is the bound class method: vLLM calls it on the class,
    and so the wrapper."""

    def from_seq_group(seq_group, use_cache: bool, seq_id_to_seq_group,
                       *args, **kwargs) -> Any:
        from vllm.sampling_params import RequestOutputKind
        parallel = seq_group.request_id in seq_id_to_seq_group
        if not parallel or not _spyre():
            return original(seq_group, use_cache, seq_id_to_seq_group,
                            *args, **kwargs)
        output = original(seq_group, False, seq_id_to_seq_group, *args,
                          **kwargs)
        params = seq_group.sampling_params
        if (output is None or params is None
                or params.output_kind != RequestOutputKind.DELTA):
            return output
        if not output.finished and not any(c.token_ids
                                           for c in output.outputs):
            return None
        if params.logprobs is not None:
            for completion in output.outputs:
                if completion.logprobs is None and not completion.token_ids:
                    completion.logprobs = []
        return output

    return from_seq_group


def _spyre() -> bool:
    from vllm.config.spyre import is_spyre
    return is_spyre()
