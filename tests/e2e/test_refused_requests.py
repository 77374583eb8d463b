"""Offline refusals leave the engine as it was: a request whose ``n`` samples
could never share a batch is refused before anything is queued (static and
continuous batching), and an ``LLM.generate`` call that fails on one of its
prompts withdraws the others, so the next call returns only its own."""
from __future__ import annotations

import pytest
import torch

from spyre_support.engines import shared_llm, spyre_llm
from spyre_support.envs import cb_env, spyre_env

# Largest batch size 2.
STATIC_ENV = spyre_env("eager", prompt_lens=[64, 128], new_tokens=[16, 8],
                       batch_sizes=[2, 1])
CB_ENV = cb_env("eager")


def tokens(ids):
    from vllm import TokensPrompt
    return TokensPrompt(prompt_token_ids=ids)


def params(**kwargs):
    from vllm import SamplingParams
    return SamplingParams(**{"max_tokens": 4, "ignore_eos": True, **kwargs})


def assert_idle(llm) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert not engine.seq_id_to_seq_group
    sched = engine.scheduler[0]
    manager = sched.block_manager
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks


def generate(llm, prompts, sampling):
    return llm.generate(prompts, sampling, use_tqdm=False)


# Function-scoped: each test takes the session's shared engine as it is
# then, so no test holds one torn down when the other mode's was built.
@pytest.fixture
def static_llm(tiny_llama):
    return shared_llm(tiny_llama, STATIC_ENV)


@pytest.fixture
def cb_llm(tiny_llama):
    # 2 sequences at once, a pool of 4 blocks of 64 tokens.
    return shared_llm(tiny_llama, CB_ENV, max_num_seqs=2, max_model_len=512,
                      num_gpu_blocks_override=4)


@pytest.mark.parametrize("sampling,n", [
    (dict(n=3, temperature=1.0, seed=1), 3),
    (dict(n=1, best_of=3, temperature=1.0, seed=1), 3),
])
def test_static_n_above_largest_batch_is_refused(static_llm, sampling, n):
    with pytest.raises(ValueError, match=rf"n={n} parallel samples .* "
                       r"largest batch size 2 "):
        generate(static_llm, [tokens([5, 6, 7])], params(**sampling))
    assert_idle(static_llm)
    # n up to the largest batch size still runs, one output per sample.
    out = generate(static_llm, [tokens([5, 6, 7])],
                   params(n=2, temperature=1.0, seed=1))
    assert [len(c.token_ids) for c in out[0].outputs] == [4, 4]
    assert_idle(static_llm)


@pytest.mark.parametrize("bad,why", [
    ([5] * 500, "longer than the maximum model length"),  # vLLM's check
    ([5] * 100, "fits none of the compiled Spyre warm-up"),  # Spyre's
])
def test_static_refused_prompt_withdraws_the_whole_call(static_llm, bad, why):
    good = [[9, 9], [3, 4, 5]]
    with pytest.raises(ValueError, match=why):
        generate(static_llm, [tokens(good[0]), tokens(bad),
                              tokens(good[1])],
                 [params(), params(max_tokens=16), params()])
    assert_idle(static_llm)
    # The next call returns its own outputs only, in its own order.
    out = generate(static_llm, [tokens([1, 2])], params(max_tokens=3))
    assert [o.prompt_token_ids for o in out] == [[1, 2]]
    assert len(out[0].outputs[0].token_ids) == 3


def test_static_refusal_after_a_parallel_request_withdraws_its_samples(
        static_llm):
    with pytest.raises(ValueError, match="fits none"):
        generate(static_llm, [tokens([9, 9]), tokens([5] * 100)],
                 [params(n=2, temperature=1.0), params(max_tokens=16)])
    assert_idle(static_llm)
    out = generate(static_llm, [tokens([1, 2])], params())
    assert [o.prompt_token_ids for o in out] == [[1, 2]]


def check_bad_grammar_is_refused_whole(llm) -> None:
    """A call whose second request has a regex no library can compile
    queues nothing, its first request included."""
    from vllm.sampling_params import GuidedDecodingParams
    guided = GuidedDecodingParams(regex="([")
    with pytest.raises(ValueError, match="Guided decoding"):
        generate(llm, [tokens([5, 6, 7]), tokens([8, 9])],
                 [params(), params(guided_decoding=guided)])
    assert_idle(llm)


def test_static_bad_grammar_is_refused_whole(static_llm):
    check_bad_grammar_is_refused_whole(static_llm)


def test_cb_bad_grammar_is_refused_whole(cb_llm):
    check_bad_grammar_is_refused_whole(cb_llm)


def test_cb_n_above_max_num_seqs_is_refused(cb_llm):
    with pytest.raises(ValueError, match=r"n=3 parallel samples .* "
                       r"--max-num-seqs=2"):
        generate(cb_llm, [tokens([5, 6, 7])], params(n=3, temperature=1.0))
    assert_idle(cb_llm)


def test_cb_n_samples_beyond_the_pool_are_refused(cb_llm):
    # One sample of 100 + 50 tokens needs 3 of the 4 blocks; two need 6.
    with pytest.raises(ValueError, match=r"n=2 parallel samples of 100 \+ "
                       r"50 tokens need 6 key/value blocks .* the 4 usable"):
        generate(cb_llm, [tokens([5] * 100)],
                 params(n=2, max_tokens=50, temperature=1.0))
    assert_idle(cb_llm)
    out = generate(cb_llm, [tokens([5] * 100)],
                   params(n=2, max_tokens=28, temperature=1.0, seed=3))
    assert [len(c.token_ids) for c in out[0].outputs] == [28, 28]
    assert_idle(cb_llm)


def test_cb_refused_prompt_withdraws_the_whole_call(cb_llm):
    with pytest.raises(ValueError, match="key/value blocks"):
        generate(cb_llm, [tokens([9, 9]), tokens([5] * 200)],
                 [params(), params(max_tokens=100)])
    assert_idle(cb_llm)
    out = generate(cb_llm, [tokens([1, 2])], params())
    assert [o.prompt_token_ids for o in out] == [[1, 2]]


@pytest.mark.parametrize("env,kwargs,feature", [
    (STATIC_ENV, dict(enable_prompt_embeds=True), "--enable-prompt-embeds"),
    (CB_ENV, dict(enable_prompt_embeds=True), "--enable-prompt-embeds"),
    (STATIC_ENV, dict(enable_prefix_caching=True),
     "Prefix caching needs continuous batching"),
    (STATIC_ENV, dict(pipeline_parallel_size=2), "ipeline parallel"),
])
def test_unsupported_features_are_refused_at_start_up(tiny_llama, env, kwargs,
                                                      feature):
    import os
    from unittest import mock

    from vllm import EngineArgs
    with mock.patch.dict(os.environ, env):
        with pytest.raises(NotImplementedError, match=feature):
            EngineArgs(model=str(tiny_llama), **kwargs).create_engine_config()


@pytest.mark.parametrize("env", [STATIC_ENV, CB_ENV])
def test_float16_is_refused_on_the_cpu_backends(tiny_llama, env):
    import os
    from unittest import mock

    from vllm import EngineArgs
    with mock.patch.dict(os.environ, env):
        with pytest.raises(ValueError, match=r"--dtype float16 is not "
                           r"supported with VLLM_SPYRE_DYNAMO_BACKEND=eager.*"
                           r"float32 and bfloat16"):
            EngineArgs(model=str(tiny_llama),
                       dtype="float16").create_engine_config()
        # auto never picks float16 here, and bfloat16 is accepted.
        assert EngineArgs(model=str(tiny_llama)).create_engine_config(
        ).model_config.dtype == torch.float32
        assert EngineArgs(model=str(tiny_llama), dtype="bfloat16"
                          ).create_engine_config().model_config.dtype == \
            torch.bfloat16


@pytest.mark.parametrize("chosen", [None, "0", "1"])
def test_usage_statistics_off_unless_the_user_chose(tiny_llama, chosen):
    """vLLM's usage-statistics thread would compete with the first batch
    and call out to the network: the platform turns it off when no switch
    is set, and keeps the user's choice when one is."""
    import os
    from unittest import mock

    from vllm import EngineArgs
    from vllm.usage import usage_lib
    env = dict(CB_ENV)
    if chosen is not None:
        env["VLLM_NO_USAGE_STATS"] = chosen
    with mock.patch.dict(os.environ, env):
        for name in ("VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK",
                     "DO_NOT_TRACK"):
            if name not in env:
                os.environ.pop(name, None)
        EngineArgs(model=str(tiny_llama)).create_engine_config()
        assert os.environ["VLLM_NO_USAGE_STATS"] == (chosen or "1")
        with mock.patch.object(usage_lib, "_USAGE_STATS_ENABLED", None), \
                mock.patch.object(usage_lib, "_USAGE_STATS_DO_NOT_TRACK_PATH",
                                  "/nonexistent/do_not_track"):
            assert usage_lib.is_usage_stats_enabled() is (chosen == "0")


@pytest.mark.parametrize("env", [STATIC_ENV, CB_ENV])
def test_configuration_too_large_is_refused_before_loading(tiny_llama, env):
    """--gpu-memory-utilization 0.01 leaves less than the process itself
    uses: refused with the numbers, before the model is loaded."""
    from unittest import mock

    from vllm.worker.spyre_runner_base import SpyreRunnerBase
    with mock.patch.object(SpyreRunnerBase, "load_model") as load:
        with pytest.raises(ValueError) as err:
            with spyre_llm(tiny_llama, env, gpu_memory_utilization=0.01):
                pass
    message = str(err.value)
    assert "Not enough memory for this Spyre configuration" in message
    assert "(--gpu-memory-utilization 0.01 of " in message
    sized_for = ("the largest shape (prompt_len="
                 if env is STATIC_ENV else "a pool of the ")
    assert sized_for in message
    load.assert_not_called()
