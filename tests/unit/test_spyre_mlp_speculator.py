"""The MLP speculator's proposer (``spyre_mlp_speculator``): its greedy
proposals equal those of vLLM's own ``MLPSpeculator.generate_proposals``
(with and without its input scaling), rows propose as many tokens as
their room allows, and after a step it keeps, per sequence, the hidden
state whose logits gave the sequence's last token: a prefill's last
position, a decode row, a verify row's position of its last emitted
token."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spyre_support.tiny_models import (build_tiny_llama,
                                       build_tiny_mlp_speculator)

K = 3


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """vLLM's parallel layers (the speculator's embeddings and heads) want
    a tensor-parallel group: one rank, torn down after the module."""
    from vllm.distributed import (destroy_distributed_environment,
                                  destroy_model_parallel,
                                  ensure_model_parallel_initialized,
                                  init_distributed_environment)
    from vllm.utils import get_open_port
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
    ensure_model_parallel_initialized(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def _proposer(tmp_path, scale_input: bool):
    import os
    from unittest import mock

    from vllm import EngineArgs
    from vllm.worker.spyre_mlp_speculator import MLPSpeculatorProposer
    target = build_tiny_llama(tmp_path / "tiny")
    speculator = build_tiny_mlp_speculator(tmp_path / "mlp", target,
                                           n_predict=K,
                                           scale_input=scale_input)
    env = {"VLLM_SPYRE_USE_CB": "1", "VLLM_SPYRE_DYNAMO_BACKEND": "eager"}
    with mock.patch.dict(os.environ, env):
        config = EngineArgs(model=str(target), max_model_len=256,
                            speculative_config={
                                "model": str(speculator),
                                "num_speculative_tokens": K
                            }).create_engine_config()
    proposer = MLPSpeculatorProposer(config)
    proposer.load()
    return proposer, config


def _vllm_proposals(module, hidden, tokens):
    """vLLM's ``generate_proposals``, greedy."""
    from vllm import SamplingParams
    from vllm.model_executor.sampling_metadata import SamplingMetadata
    from vllm.sequence import SequenceData, SequenceGroupMetadata
    metas = [SequenceGroupMetadata(
        request_id=f"r{i}", is_prompt=False,
        seq_data={i: SequenceData.from_seqs([1], [int(t)])},
        sampling_params=SamplingParams(temperature=0),
        block_tables={i: [0]}) for i, t in enumerate(tokens)]
    sm = SamplingMetadata.prepare(metas, [2] * len(metas), [1] * len(metas),
                                  "cpu", pin_memory=False)
    # vLLM's speculative workers had the sampler return the sampled ids.
    module.sampler.include_gpu_probs_tensor = True
    outs = module.generate_proposals(tokens, hidden, K, sm)
    return [tuple(int(o.sampled_token_ids[i]) for o in outs)
            for i in range(len(tokens))]


@pytest.mark.parametrize("scale_input", [False, True])
def test_proposals_equal_vllms_mlp_speculator(tmp_path, scale_input):
    proposer, _ = _proposer(tmp_path, scale_input)
    torch.manual_seed(0)
    hidden = torch.randn(4, proposer.module.emb_dim)
    tokens = torch.tensor([5, 17, 200, 33])
    ids = [f"q{i}" for i in range(4)]
    for request_id, row in zip(ids, hidden):
        proposer.keep(request_id, row)
    with torch.inference_mode():
        want = _vllm_proposals(proposer.module, hidden, tokens)
    got = proposer._propose(ids, tokens.tolist(), [K] * 4)
    assert list(got) == want
    # Rooms cut the proposals; a sequence without a kept state and one
    # without room propose nothing.
    got = proposer._propose(ids + ["unknown"], tokens.tolist() + [1],
                            [1, 0, 2, K, K])
    assert list(got) == [want[0][:1], (), want[2][:2], want[3], ()]


def test_the_kept_state_is_the_one_behind_the_last_token(tmp_path):
    proposer, _ = _proposer(tmp_path, False)
    width = proposer.module.emb_dim
    prefill_hidden = torch.randn(1, width)
    metas = [SimpleNamespace(request_id="a"), SimpleNamespace(request_id="b")]

    def group(n):
        return SimpleNamespace(samples=[None] * n)

    # A prefill of "p" and two decode rows.
    decode_hidden = torch.randn(3, width)  # a padding row too
    step = SimpleNamespace(prefill=object(), sample_prefill=True,
                           prefill_request="p", decode_metas=metas,
                           verify=None)
    proposer.stepped(step, [group(1)] * 3, (prefill_hidden, decode_hidden))
    assert torch.equal(proposer.hidden["p"], prefill_hidden[0])
    assert torch.equal(proposer.hidden["a"], decode_hidden[0])
    assert torch.equal(proposer.hidden["b"], decode_hidden[1])
    # A verify step: "a" emitted 3 tokens, "b" 1.
    verify_hidden = torch.randn(2, K + 1, width)
    step = SimpleNamespace(prefill=None, decode_metas=metas,
                           verify=object())
    proposer.stepped(step, [group(3), group(1)], (None, verify_hidden))
    assert torch.equal(proposer.hidden["a"], verify_hidden[0, 2])
    assert torch.equal(proposer.hidden["b"], verify_hidden[1, 0])
    # A prefill chunk that samples nothing keeps nothing for it.
    step = SimpleNamespace(prefill=object(), sample_prefill=False,
                           prefill_request="c", decode_metas=(),
                           verify=None)
    proposer.stepped(step, [], (torch.randn(1, width), None))
    assert "c" not in proposer.hidden
    proposer.forget(["a", "p"])
    assert set(proposer.hidden) == {"b"}
