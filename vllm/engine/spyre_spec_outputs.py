"""The engine's side of speculative decoding: several tokens a step.

vLLM's V0 engine appends one token per sequence per step
(``SingleStepOutputProcessor``); a Spyre verify step
(``spyre_spec_model_runner``) emits up to ``k + 1``.  With
``--speculative-config`` on Spyre, ``install`` (a ``vllm.general_plugins``
entry point) gives each new ``LLMEngine`` a
``SpyreSpeculativeOutputProcessor``, which appends a step's tokens one at
a time, detokenizing and checking the stop conditions after each as vLLM
does for one (a stop string, an end-of-sequence token or ``max_tokens``
met by an early one drops the rest), and counts the sequence's accepted
proposals as computed.

It also keeps vLLM's speculative-decoding counters (the names vLLM's V1
engine exports on ``/metrics``): ``vllm:spec_decode_num_drafts`` (verify
rows with proposals), ``vllm:spec_decode_num_draft_tokens`` (tokens
proposed) and ``vllm:spec_decode_num_accepted_tokens`` (proposals kept),
and logs the acceptance rate and mean accepted length at most every
``LOG_EVERY_S`` seconds.
"""
from __future__ import annotations

import time
from typing import Optional

from vllm.engine.spyre_upstream_wraps import wrap_once
from vllm.logger import init_logger

logger = init_logger(__name__)

#: Seconds between two log lines of the acceptance figures.
LOG_EVERY_S = 10.0


def install() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    from vllm.engine.llm_engine import LLMEngine
    wrap_once(LLMEngine, "__init__", _with_speculative_outputs)


def _with_speculative_outputs(original):

    def __init__(engine, *args, **kwargs) -> None:
        original(engine, *args, **kwargs)
        from vllm.config.spyre import is_spyre
        if engine.vllm_config.speculative_config is None or not is_spyre():
            return
        engine.output_processor = _processor(
            engine.output_processor,
            SpecCounters(engine.model_config.served_model_name))

    return __init__


def _processor(single, counters: "SpecCounters"):
    from vllm.engine.output_processor.single_step import \
        SingleStepOutputProcessor

    class SpyreSpeculativeOutputProcessor(SingleStepOutputProcessor):
        """Appends every token a step emitted for a sequence."""

        def _process_sequence_group_outputs(self, seq_group, outputs,
                                            is_async: bool) -> None:
            samples = outputs.samples
            proposed = getattr(outputs, "proposed", 0)
            if proposed:
                counters.verified(proposed, len(samples) - 1)
            if len(samples) <= 1 or is_async:
                return super()._process_sequence_group_outputs(
                    seq_group, outputs, is_async)
            seq = seq_group.first_seq
            params = seq_group.sampling_params
            appended = 0
            for sample in samples:
                seq.append_token_id(sample.output_token, sample.logprobs,
                                    sample.output_embed)
                appended += 1
                new_chars = 0
                if params.detokenize and self.detokenizer:
                    new_chars = self.detokenizer.decode_sequence_inplace(
                        seq, params)
                self.stop_checker.maybe_stop_sequence(
                    seq, new_chars, params, lora_req=seq_group.lora_request)
                if seq.is_finished():
                    break
            if seq.is_finished():
                for scheduler in self.scheduler:
                    scheduler.free_seq(seq)
            else:
                # The accepted proposals' keys and values are in the pool;
                # the last token is fed back next step.
                seq.data.update_num_computed_tokens(appended - 1)

    processor = SpyreSpeculativeOutputProcessor(single.scheduler_config,
                                                single.detokenizer,
                                                single.scheduler,
                                                single.seq_counter,
                                                single.stop_checker)
    processor.counters = counters
    return processor


class SpecCounters:
    """vLLM's speculative-decoding counters, and a periodic log line."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.drafts = self.draft_tokens = self.accepted = 0
        self._logged = (0, 0, 0)
        self._last_log = time.monotonic()
        self._prom: Optional[tuple] = None
        try:
            from prometheus_client import Counter
            made = []
            for name, doc in (
                ("vllm:spec_decode_num_drafts",
                 "Number of spec decoding drafts."),
                ("vllm:spec_decode_num_draft_tokens",
                 "Number of draft tokens."),
                ("vllm:spec_decode_num_accepted_tokens",
                 "Number of accepted tokens."),
            ):
                made.append(
                    Counter(name, doc, labelnames=list(self.labels)).labels(
                        **self.labels))
            self._prom = tuple(made)
        except ValueError:  # registered already in this process
            self._prom = None

    def verified(self, proposed: int, accepted: int) -> None:
        """One sequence's verify step: ``proposed`` tokens, ``accepted``
        of them kept."""
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted += accepted
        if self._prom is not None:
            drafts, tokens, kept = self._prom
            drafts.inc()
            tokens.inc(proposed)
            kept.inc(accepted)
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            self.log()

    def log(self) -> None:
        drafts = self.drafts - self._logged[0]
        tokens = self.draft_tokens - self._logged[1]
        accepted = self.accepted - self._logged[2]
        self._logged = (self.drafts, self.draft_tokens, self.accepted)
        if drafts:
            logger.info(
                "Speculative decoding: %d drafts of %d tokens, %d accepted "
                "(acceptance rate %.1f%%, mean accepted length %.2f)",
                drafts, tokens, accepted, 100.0 * accepted / tokens,
                1.0 + accepted / drafts)
