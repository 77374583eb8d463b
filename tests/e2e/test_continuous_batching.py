"""Continuous batching (``VLLM_SPYRE_USE_CB=1``) end to end, offline.

Requests of very different sizes share a decode batch of
``--max-num-seqs 3``, so they join and leave mid-flight; greedy ids must
equal Hugging Face transformers for every request, on both CPU backends,
with nothing compiled after warm-up.  Again with a block pool so small that
the scheduler preempts (and recomputes) requests; a scripted arrival order
gives an exact step table; tensor parallel over 3 ranks equals 1 rank;
requests that can never fit are refused up front."""
from __future__ import annotations

import pytest
import torch

from spyre_support.engines import (collector_reach, compile_count,
                                   first_logprob, spyre_engine,
                                   spyre_llm)
from spyre_support.envs import cb_env, TORCH_OPS
from spyre_support.reference import HFReference

MAX_NUM_SEQS = 3
MAX_MODEL_LEN = 576  # 9 blocks of 64
# (prompt length, max_tokens): 3 to 450 tokens, 1 to 64 new tokens; chunk
# and block boundaries (63, 64, 65, 128) on both sides.
PLAN = [(3, 64), (450, 5), (70, 1), (128, 33), (64, 64), (200, 12), (5, 40),
        (300, 7), (65, 20), (17, 3), (63, 9)]
# Three requests that each hold 2 blocks at prefill and grow to 3 while
# decoding: with 7 blocks the scheduler must preempt one of them.
PREEMPT_PLAN = [(100, 60), (110, 50), (120, 40), (5, 30), (300, 20)]
LOGPROB_ATOL = 1e-3


def make_requests(vocab: int, plan=PLAN) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randint(4, vocab, (n, ), generator=gen).tolist(), m)
            for n, m in plan]


def generate(llm, reqs, logprobs=None):
    from vllm import SamplingParams, TokensPrompt
    return llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p, _ in reqs],
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True,
                        logprobs=logprobs) for _, m in reqs],
        use_tqdm=False)


def run_workload(model, backend, plan=PLAN, **kwargs) -> dict:
    at_start = compile_count()
    with spyre_llm(model, cb_env(backend), max_num_seqs=MAX_NUM_SEQS,
                   max_model_len=MAX_MODEL_LEN, **kwargs) as llm:
        warmup_compiles = compile_count() - at_start
        reqs = make_requests(llm.llm_engine.model_config.get_vocab_size(),
                             plan)
        before = compile_count()
        outputs = generate(llm, reqs, logprobs=0)
        compiled = compile_count() - before
        scheduler = llm.llm_engine.scheduler[0]
        manager = scheduler.block_manager
        seen = dict(
            reqs=reqs, outputs=outputs, compiled=compiled,
            warmup_compiles=warmup_compiles,
            preemptions=scheduler.num_cumulative_preemption,
            free_blocks=manager.get_num_free_gpu_blocks(),
            total_blocks=manager.num_total_gpu_blocks,
            worker=type(llm.llm_engine.model_executor.driver_worker.worker
                        ).__name__,
            timings=llm.collective_rpc("get_startup_timings")[0],
            reach=collector_reach(llm, outputs),
            prefill_shape=tuple(llm.llm_engine.model_executor.driver_worker
                                .worker.model_runner._chunks(
                                    list(range(4, 134)),
                                    [0, 1, 2]).input_ids.shape))
    return seen


@pytest.fixture(scope="module", params=["eager", "inductor", TORCH_OPS])
def cb_run(request, tiny_llama):
    return dict(run_workload(tiny_llama, request.param),
                backend=request.param)


def assert_matches_hf(run, hf):
    for (prompt, max_tokens), out in zip(run["reqs"], run["outputs"]):
        ref_ids, ref_lp = hf.greedy(prompt, max_tokens)
        got = list(out.outputs[0].token_ids)
        assert got == ref_ids, (f"prompt of {len(prompt)} tokens, "
                                f"max_tokens={max_tokens}")
        lp = first_logprob(out.outputs[0])
        if lp is not None:
            assert lp == pytest.approx(ref_lp, abs=LOGPROB_ATOL)


def test_greedy_ids_match_transformers(cb_run, hf_tiny):
    assert cb_run["worker"] == "SpyreCBWorker"
    assert_matches_hf(cb_run, hf_tiny)


def test_no_compilation_after_warmup(cb_run):
    assert cb_run["warmup_compiles"] > 0
    assert cb_run["compiled"] == 0
    assert set(cb_run["timings"]) == {"load", "warmup"}


def test_start_up_objects_are_left_out_of_collections(cb_run):
    """Frozen after the pool's warm-up (``SpyreCBWorker``), as after the
    static warm-up; what serving makes is still collected."""
    reach = cb_run["reach"]
    assert reach["frozen"] > 0 and not reach["runner"]
    assert reach["made_later"]


def test_prefill_runs_in_one_pass_on_the_paged_kernel(cb_run):
    """A 130-token prefill: one [1, 130] pass on the paged C++ kernel
    (eager and inductor), three 64-token chunks on the torch ops."""
    from vllm.spyre_kernels import ops as native
    whole = cb_run["backend"] != TORCH_OPS and native.available()
    assert cb_run["prefill_shape"] == ((1, 130) if whole else (3, 64))


def test_every_block_is_free_at_the_end(cb_run):
    assert cb_run["free_blocks"] == cb_run["total_blocks"]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_preempted_requests_finish_with_the_same_tokens(
        tiny_llama, hf_tiny, backend):
    run = run_workload(tiny_llama, backend, PREEMPT_PLAN,
                       num_gpu_blocks_override=7)
    assert run["total_blocks"] == 7
    assert run["preemptions"] > 0
    assert run["compiled"] == 0
    assert run["free_blocks"] == 7
    assert_matches_hf(run, hf_tiny)


def test_tensor_parallel_3_equals_1(tiny_llama_3kv):
    plan = [(3, 12), (130, 5), (64, 9), (20, 1), (70, 7)]
    results = {}
    for tp in (1, 3):
        with spyre_llm(tiny_llama_3kv, cb_env("eager"),
                       tensor_parallel_size=tp, max_num_seqs=2,
                       max_model_len=256) as llm:
            reqs = make_requests(
                llm.llm_engine.model_config.get_vocab_size(), plan)
            outs = generate(llm, reqs)
            results[tp] = [list(o.outputs[0].token_ids) for o in outs]
            executor = type(llm.llm_engine.model_executor).__name__
    assert executor == "MultiprocessingSpyreExecutor"
    hf = HFReference(tiny_llama_3kv)
    reference = [hf.greedy(p, m)[0] for p, m in reqs]
    assert results[1] == reference
    assert results[3] == results[1]


# ---- the step table --------------------------------------------------------

def record_steps(engine) -> list:
    """Wraps the scheduler so that every step's kind, requests and the
    blocks each request holds are recorded."""
    scheduler = engine.scheduler[0]
    steps: list = []
    schedule = scheduler.schedule

    def recording_schedule():
        metas, outputs, allow_async = schedule()
        if metas:
            kind = "prefill" if metas[0].is_prompt else "decode"
            steps.append((kind, {
                m.request_id: len(next(iter(m.block_tables.values())))
                for m in metas
            }))
        return metas, outputs, allow_async

    scheduler.schedule = recording_schedule
    return steps


def test_step_table(tiny_llama):
    """max_num_seqs=2; A (70 tokens, 3 new), B (10, 4) arrive first, C (60,
    6) after the second step.  A prefill step pauses decoding; a request
    joins as soon as one leaves; C grows into its second block at the step
    that writes its 65th token."""
    from vllm import SamplingParams, TokensPrompt
    table = [
        ("prefill", {"A": 2}),
        ("prefill", {"B": 1}),
        ("decode", {"A": 2, "B": 1}),   # A: 2 tokens, B: 2
        ("decode", {"A": 2, "B": 1}),   # A: 3 (done), B: 3
        ("prefill", {"C": 1}),          # C takes A's place
        ("decode", {"B": 1, "C": 1}),   # B: 4 (done), C: 2
        ("decode", {"C": 1}),           # C: 3
        ("decode", {"C": 1}),           # C: 4
        ("decode", {"C": 1}),           # C: 5; token 1 fed back to slot 63
        ("decode", {"C": 2}),           # C: 6 (done); slot 64: a new block
    ]
    with spyre_engine(tiny_llama, cb_env("eager"), max_num_seqs=2,
                      max_model_len=256) as engine:
        steps = record_steps(engine)

        def add(rid, n, max_tokens):
            engine.add_request(
                rid, TokensPrompt(prompt_token_ids=[5 + i % 50
                                                    for i in range(n)]),
                SamplingParams(temperature=0, max_tokens=max_tokens,
                               ignore_eos=True))

        add("A", 70, 3)
        add("B", 10, 4)
        finished = {}
        for i in range(len(table)):
            if i == 2:
                add("C", 60, 6)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = len(out.outputs[0].token_ids)
        assert not engine.has_unfinished_requests()
        free = engine.scheduler[0].block_manager.get_num_free_gpu_blocks()
        total = engine.scheduler[0].block_manager.num_total_gpu_blocks
    assert steps == table
    assert finished == {"A": 3, "B": 4, "C": 6}
    assert free == total


# ---- refusals --------------------------------------------------------------

def test_impossible_requests_are_refused_up_front(tiny_llama):
    from vllm import SamplingParams, TokensPrompt
    with spyre_engine(tiny_llama, cb_env("eager"), max_num_seqs=2,
                      max_model_len=256, num_gpu_blocks_override=3) as engine:
        with pytest.raises(ValueError, match=r"needs 261 tokens .*"
                           r"max_model_len=256"):
            engine.add_request(
                "long", TokensPrompt(prompt_token_ids=[5] * 200),
                SamplingParams(max_tokens=61))
        with pytest.raises(ValueError, match=r"needs 4 key/value blocks.*"
                           r"the 3 usable blocks"):
            engine.add_request(
                "wide", TokensPrompt(prompt_token_ids=[5] * 150),
                SamplingParams(max_tokens=50))
        # Nothing was queued, and a request that fits still runs.
        assert not engine.has_unfinished_requests()
        engine.add_request("ok", TokensPrompt(prompt_token_ids=[5] * 150),
                           SamplingParams(max_tokens=4, ignore_eos=True))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
    assert [len(o.outputs[0].token_ids) for o in outs] == [4]


def test_warmup_settings_are_ignored_with_a_warning(tiny_llama, caplog):
    env = dict(cb_env("eager"), VLLM_SPYRE_WARMUP_BATCH_SIZES="4")
    with spyre_llm(tiny_llama, env, max_num_seqs=2,
                   max_model_len=128) as llm:
        outs = generate(llm, [([5, 6, 7], 3)])
    assert len(outs[0].outputs[0].token_ids) == 3
    assert any("VLLM_SPYRE_WARMUP_BATCH_SIZES is set but ignored" in
               r.getMessage() for r in caplog.records)


def test_ray_backend_tp2(tiny_llama, hf_tiny):
    """Continuous batching on a one-machine Ray cluster declaring 2 cards."""
    import ray
    plan = [(3, 12), (130, 5), (64, 9), (20, 1)]
    ray.init(num_cpus=2, resources={"spyre": 2}, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        with spyre_llm(tiny_llama, cb_env("eager"), tensor_parallel_size=2,
                       distributed_executor_backend="ray", max_num_seqs=2,
                       max_model_len=256) as llm:
            executor = type(llm.llm_engine.model_executor).__name__
            reqs = make_requests(
                llm.llm_engine.model_config.get_vocab_size(), plan)
            got = [list(o.outputs[0].token_ids) for o in generate(llm, reqs)]
            llm.llm_engine.model_executor.shutdown()
    finally:
        ray.shutdown()
    assert executor == "RaySpyreExecutor"
    assert got == [hf_tiny.greedy(p, m)[0] for p, m in reqs]


# ---- sampling within one batch ---------------------------------------------

def test_per_request_sampling_in_one_batch(tiny_llama):
    """Seeded random sampling gives the same tokens alone and beside other
    requests; greedy, n=2, stop tokens and logprobs share the batch."""
    from vllm import SamplingParams, TokensPrompt
    prompt = TokensPrompt(prompt_token_ids=[7, 8, 9, 10, 11])
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234,
                            max_tokens=12, ignore_eos=True)
    with spyre_llm(tiny_llama, cb_env("eager"), max_num_seqs=4,
                   max_model_len=256) as llm:
        alone = llm.generate([prompt], [seeded], use_tqdm=False)[0]
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        ref = llm.generate([prompt], [greedy], use_tqdm=False)[0]
        stop_at = ref.outputs[0].token_ids[3]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=[20] * 70), prompt, prompt,
             prompt, prompt],
            [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
             seeded,
             # n=2 of a one-token top-k: both samples are the greedy ones.
             SamplingParams(temperature=1.0, top_k=1, max_tokens=10,
                            ignore_eos=True, n=2),
             SamplingParams(temperature=0, max_tokens=10,
                            stop_token_ids=[stop_at]),
             SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                            logprobs=3)],
            use_tqdm=False)
    ref_ids = list(ref.outputs[0].token_ids)
    assert len(set(ref_ids)) > 1  # the seeded run below is not trivial
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert [list(c.token_ids) for c in outs[2].outputs] == [ref_ids] * 2
    stopped = list(outs[3].outputs[0].token_ids)
    assert stopped == ref_ids[:ref_ids.index(stop_at) + 1]
    assert outs[3].outputs[0].finish_reason == "stop"
    lp = outs[4].outputs[0].logprobs
    assert list(outs[4].outputs[0].token_ids) == ref_ids
    assert all(len(step) >= 3 for step in lp)
    assert all(step[t].rank == 1 for step, t in zip(lp, ref_ids))


@pytest.mark.smollm2
def test_smollm2_matches_transformers(smollm2):
    run = run_workload(smollm2, "eager")
    assert run["compiled"] == 0
    assert_matches_hf(run, HFReference(smollm2))


@pytest.mark.parametrize("max_model_len, prompt_len, max_tokens",
                         [(128, 64, 64), (64, 40, 24)])
def test_the_sized_pool_never_preempts_a_full_batch(
        tiny_llama, hf_tiny, max_model_len, prompt_len, max_tokens):
    """The pool sized at start-up holds --max-num-seqs sequences of
    --max-model-len tokens without preempting any (vLLM's block manager
    wants one free block per decoding sequence); a one-block
    max_model_len starts too."""
    plan = [(prompt_len, max_tokens)] * 3
    with spyre_llm(tiny_llama, cb_env("eager"), max_num_seqs=3,
                   max_model_len=max_model_len) as llm:
        reqs = make_requests(llm.llm_engine.model_config.get_vocab_size(),
                             plan)
        outs = generate(llm, reqs)
        preemptions = llm.llm_engine.scheduler[0].num_cumulative_preemption
    assert preemptions == 0
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        hf_tiny.greedy(p, m)[0] for p, m in reqs]
