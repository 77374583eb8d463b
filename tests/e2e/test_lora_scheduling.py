"""More adapters than ``--max-loras`` as a step table: a request whose
adapter would be one too many in the running batch waits, as vLLM's
scheduler makes it, until the requests of a running adapter finish; the
log says so once, naming the count and the limit (continuous batching, the
tiny Llama on vLLM's model code, eager)."""
from __future__ import annotations

import logging

import pytest

from spyre_support.engines import spyre_engine
from spyre_support.envs import cb_env
from spyre_support.tiny_lora import build_adapter


@pytest.fixture(scope="module")
def two_adapters(tiny_llama, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("waits")
    return {name: build_adapter(tiny_llama, root / name, seed=seed, rank=4)
            for name, seed in (("first", 11), ("second", 12))}


class Lines(logging.Handler):
    """The messages a logger emits (vLLM's loggers do not propagate to
    the root logger pytest captures)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def test_a_request_waits_for_an_adapter_slot(tiny_llama, two_adapters):
    from vllm import SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest
    requests = [("a1", "first", 4), ("a2", "first", 2), ("b", "second", 2)]
    with spyre_engine(tiny_llama, cb_env("eager"), model_impl="vllm",
                      enable_lora=True, max_loras=1, max_lora_rank=8,
                      max_num_seqs=4, max_model_len=128) as engine:
        ids = {"first": 1, "second": 2}
        for rid, name, tokens in requests:
            engine.add_request(
                rid, TokensPrompt(prompt_token_ids=[5 + len(rid)] * 8),
                SamplingParams(max_tokens=tokens, temperature=0,
                               ignore_eos=True),
                lora_request=LoRARequest(name, ids[name],
                                         str(two_adapters[name])))
        sched = engine.scheduler[0]
        table, lines = [], Lines()
        logger = logging.getLogger("vllm.core.spyre_scheduler_base")
        logger.addHandler(lines)
        try:
            while engine.has_unfinished_requests():
                done = sorted(o.request_id for o in engine.step()
                              if o.finished)
                table.append((sorted(g.request_id for g in sched.running),
                              [g.request_id for g in sched.waiting], done))
        finally:
            logger.removeHandler(lines)
    assert table == [
        # running, waiting, finished in this step
        (["a1"], ["a2", "b"], []),  # one prefill a step
        (["a1", "a2"], ["b"], []),  # a2 shares a1's adapter
        (["a1"], ["b"], ["a2"]),
        (["a1"], ["b"], []),  # b's adapter would be a second one
        ([], ["b"], ["a1"]),
        (["b"], [], []),  # the first adapter's requests are done
        ([], [], ["b"]),
    ]
    assert lines.said == [
        "Request b waits for an adapter slot: its adapter 'second' would "
        "make 2 different adapters in the running batch, more than "
        "--max-loras=1"]
