"""GPT-OSS beyond what every family is tested for (``test_model_families``
serves the same tiny checkpoint under static batching, continuous batching,
``inductor`` and TP=3): its sinks, windows, biases and clamp each change
transformers' answers, so a model that dropped one fails; a prompt longer
than the sliding layers' window through chunked prefill and from a cached
prefix; prompt log-probabilities; and the checkpoints it cannot read
refused by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from spyre_support.engines import greedy_requests, model_runner, spyre_llm
from spyre_support.envs import cb_env, spyre_env
from spyre_support.reference import (HFReference,
                                     prompt_logprobs_match_transformers)
from spyre_support.tiny_models import build_tiny_family
from spyre_support.tiny_models import GPT_OSS_WINDOW

STATIC = dict(prompt_lens=[64], new_tokens=[16], batch_sizes=[2])
CB = cb_env("eager")
CB_ARGS = dict(max_model_len=192, max_num_seqs=3)


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, 380, (n, ), generator=gen).tolist()


#: Two prompts sharing their first 64-token block, and a short one.
PREFIX = _ids(64, 1)
REQUESTS = [(PREFIX + _ids(30, 2), 12), (PREFIX + _ids(45, 3), 16),
            (_ids(9, 4), 10)]


def _greedy(path, requests, change=None) -> list[list[int]]:
    hf = HFReference(path)
    if change is not None:
        with torch.no_grad():
            change(hf.model)
    return [hf.greedy(p, m)[0] for p, m in requests]


def _no_sinks(model) -> None:
    for name, param in model.named_parameters():
        if name.endswith("sinks"):
            param.fill_(-1e9)


def _no_window(model) -> None:
    model.config.sliding_window = 10**6
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None


def _no_expert_biases(model) -> None:
    for layer in model.model.layers:
        layer.mlp.experts.gate_up_proj_bias.zero_()
        layer.mlp.experts.down_proj_bias.zero_()
        layer.mlp.router.bias.zero_()


def _no_clamp(model) -> None:
    for layer in model.model.layers:
        layer.mlp.experts.limit = 1e9


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(checkpoint folder, transformers' greedy ids of REQUESTS)."""
    path = build_tiny_family("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))
    return path, _greedy(path, REQUESTS)


@pytest.mark.parametrize("change", [_no_sinks, _no_window, _no_expert_biases,
                                    _no_clamp],
                         ids=["sinks", "window", "expert_biases", "clamp"])
def test_each_feature_changes_the_answers(gpt_oss, change):
    """The tiny checkpoint is one on which each of GPT-OSS's features
    matters: without it transformers answers otherwise, so every
    comparison with transformers also checks that Spyre applies it."""
    path, expected = gpt_oss
    assert _greedy(path, REQUESTS, change) != expected


def test_chunked_prefill_and_prefix_caching(gpt_oss):
    """Continuous batching with 64-token chunks and prefix caching: the
    second prompt finds the shared block cached, and each of its positions
    on the sliding layer sees its last GPT_OSS_WINDOW tokens across the
    chunk and cache boundaries."""
    path, expected = gpt_oss
    with spyre_llm(path, CB, enable_chunked_prefill=True,
                   max_num_batched_tokens=64, enable_prefix_caching=True,
                   **CB_ARGS) as llm:
        assert greedy_requests(llm, REQUESTS[:1]) == expected[:1]
        before = model_runner(llm).prompt_tokens_computed
        assert greedy_requests(llm, REQUESTS[1:]) == expected[1:]
        computed = model_runner(llm).prompt_tokens_computed - before
    assert computed == (len(REQUESTS[1][0]) - 64) + len(REQUESTS[2][0])


def test_prompt_logprobs(gpt_oss):
    """A 94-token prompt's log-probabilities (FMS's attention with sinks
    over the whole prompt, each layer over its window) equal
    transformers'."""
    path, _ = gpt_oss
    assert len(REQUESTS[0][0]) > GPT_OSS_WINDOW
    with spyre_llm(path, spyre_env("eager", [128], [16], [2])) as llm:
        prompt_logprobs_match_transformers(llm, path, REQUESTS[0][0])


def test_mxfp4_checkpoint_refused(gpt_oss, tmp_path):
    """OpenAI's released layout (MXFP4 experts, ``*_blocks`` and
    ``*_scales``) is refused at load, naming the tensor."""
    from safetensors.torch import load_file, save_file
    path, _ = gpt_oss
    shutil.copytree(path, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    state = load_file(weights)
    state["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(
        4, 2, 1, 16, dtype=torch.uint8)
    save_file(state, weights)
    with pytest.raises(NotImplementedError, match="gate_up_proj_blocks"):
        with spyre_llm(tmp_path / "m", spyre_env("eager", **STATIC)):
            pass


def test_dynamic_rope_refused(gpt_oss, tmp_path):
    """A rotary scaling whose frequencies change with the sequence length
    is refused at start-up, naming it."""
    path, _ = gpt_oss
    shutil.copytree(path, tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    config_path.write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="'dynamic'"):
        with spyre_llm(tmp_path / "m", spyre_env("eager", **STATIC)):
            pass
