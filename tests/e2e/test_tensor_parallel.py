"""Tensor parallelism over several (CPU stand-in) cards: greedy ids of TP=2
equal TP=1 and transformers, offline and through the OpenAI server; the card
count from the environment; the generic multiprocessing base with a plain
CPU mixin; a dead rank fails fast."""
from __future__ import annotations

import os
import re
import subprocess
import time
import sys
import textwrap
from unittest import mock

import psutil
import pytest
import requests
import torch

from spyre_support.engines import spyre_llm
from spyre_support.envs import spyre_env
from spyre_support.paths import REPO
from spyre_support.server import Server

SHAPES = dict(prompt_lens=[64, 128], new_tokens=[8, 4], batch_sizes=[2, 1])
REQUESTS = [([5, 6, 7, 8, 9, 10], 8), ([11] * 20, 5), ([3] * 7, 8),
            ([40] * 100, 4), ([9, 8] * 12, 2)]



def generate(llm):
    from vllm import SamplingParams, TokensPrompt
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p, _ in REQUESTS],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
         for _, n in REQUESTS], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_tp2_matches_tp1_and_transformers(tiny_llama, hf_tiny, backend):
    env = spyre_env(backend, **SHAPES)
    with spyre_llm(tiny_llama, env, tensor_parallel_size=2) as llm:
        executor = type(llm.llm_engine.model_executor).__name__
        tp2 = generate(llm)
    assert executor == "MultiprocessingSpyreExecutor"
    reference = [hf_tiny.greedy(p, n)[0] for p, n in REQUESTS]
    assert tp2 == reference
    if backend == "eager":
        with spyre_llm(tiny_llama, env) as llm:
            assert generate(llm) == tp2


def test_tp2_applies_structured_output_where_it_samples(tiny_llama):
    """Only the driver samples, so only it holds and applies a request's
    grammar (``vllm.engine.spyre_structured_output``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import GuidedDecodingParams
    env = spyre_env("eager", [64], [16], [2])
    with spyre_llm(tiny_llama, env, tensor_parallel_size=2,
                   guided_decoding_backend="xgrammar",
                   guided_decoding_disable_any_whitespace=True) as llm:
        outs = llm.generate(["the spyre card"] * 2, [
            SamplingParams(max_tokens=16, temperature=0, guided_decoding=g)
            for g in (GuidedDecodingParams(regex=r"[a-c]{3}-\d{2}"),
                      GuidedDecodingParams(choice=["spyre", "card"]))
        ], use_tqdm=False)
    assert re.fullmatch(r"[a-c]{3}-\d{2}", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("spyre", "card")


def test_aiu_world_size_sets_the_card_count(tiny_llama, hf_tiny):
    env = dict(spyre_env("eager", **SHAPES), AIU_WORLD_SIZE="2")
    with spyre_llm(tiny_llama, env) as llm:
        config = llm.llm_engine.vllm_config.parallel_config
        assert config.tensor_parallel_size == 2
        assert config.world_size == 2
        threads = llm.collective_rpc(lambda w: torch.get_num_threads())
        assert generate(llm) == [hf_tiny.greedy(p, n)[0]
                                 for p, n in REQUESTS]
    cores = len(os.sched_getaffinity(0))
    assert threads == [max(1, cores // 2)] * 2


@pytest.mark.parametrize("extra,flag,message", [
    (dict(AIU_WORLD_SIZE="3"), 2, "AIU_WORLD_SIZE"),
    (dict(SPYRE_DEVICES="0,1,2"), 2, "SPYRE_DEVICES"),
])
def test_flag_disagreeing_with_environment_is_an_error(tiny_llama, extra,
                                                       flag, message):
    from vllm import EngineArgs
    env = dict(spyre_env("eager", **SHAPES), **extra)
    with mock.patch.dict(os.environ, env):
        with pytest.raises(ValueError) as err:
            EngineArgs(model=str(tiny_llama),
                       tensor_parallel_size=flag).create_engine_config()
    assert f"--tensor-parallel-size {flag}" in str(err.value)
    assert message in str(err.value)


def test_tp2_through_the_openai_server(tiny_llama, hf_tiny):
    with Server(tiny_llama, spyre_env("eager", **SHAPES),
                args=("--tensor-parallel-size", "2")) as srv:
        got = []
        for prompt, n in REQUESTS:
            resp = requests.post(srv.url + "/v1/completions", json=dict(
                model=srv.model, prompt=prompt, max_tokens=n, temperature=0,
                ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True),
                timeout=120)
            assert resp.status_code == 200, resp.text
            got.append([int(t.split(":")[1]) for t in
                        resp.json()["choices"][0]["logprobs"]["tokens"]])
        log = srv.log()
        # A dead rank: the server stops reporting healthy within seconds.
        rank1 = re.findall(r"rank 1 runs in process (\d+)", log)
        assert len(rank1) == 1
        psutil.Process(int(rank1[0])).kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(srv.url + "/health", timeout=5).status_code \
                        != 200:
                    break
            except requests.RequestException:
                break
            time.sleep(0.5)
        else:
            pytest.fail("server still healthy 30 s after a rank died")
    assert got == [hf_tiny.greedy(p, n)[0] for p, n in REQUESTS]
    assert "MultiprocessingSpyreExecutor: 2 ranks ready" in log


def test_generic_base_with_a_plain_cpu_mixin(tiny_llama):
    """The base starts, drives and stops plain CPU workers: nothing in it
    assumes Spyre."""
    from vllm import EngineArgs
    from vllm.executor.spyre_multiproc_executor_base import (
        MultiprocessingExecutor)

    class PlainMixin:
        def _rank_env(self, rank):
            return {"PLAIN_RANK_TAG": f"rank-{rank}"}

    class PlainCPUExecutor(PlainMixin, MultiprocessingExecutor):
        pass

    with mock.patch.dict(os.environ, spyre_env("eager", **SHAPES)):
        config = EngineArgs(model=str(tiny_llama)).create_engine_config()
    # Three ranks of a worker that holds no model at all.
    config.parallel_config.tensor_parallel_size = 3
    config.parallel_config.world_size = 3
    config.parallel_config.worker_cls = (
        "spyre_support.plain_cpu_worker.PlainCPUWorker")
    executor = PlainCPUExecutor(vllm_config=config)
    try:
        assert executor.collective_rpc("sum_of_ranks") == [3, 3, 3]
        assert executor.collective_rpc("rank_tag") == [
            "rank-0", "rank-1", "rank-2"]
        pids = executor.collective_rpc("pid")
        assert pids[0] == os.getpid() and len(set(pids)) == 3
        executor.check_health()
        # Rank 0's variable was set while it started, not left behind.
        assert "PLAIN_RANK_TAG" not in os.environ
    finally:
        executor.collective_rpc("shutdown")
        executor.shutdown()


def test_dead_rank_fails_fast(tiny_llama, tmp_path):
    """Killing rank 1 mid-generation ends generate() with an error, well
    within the test's time limit."""
    script = tmp_path / "kill_rank.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, threading, time
        from vllm import LLM, SamplingParams, TokensPrompt

        if __name__ == "__main__":
            llm = LLM(model={str(tiny_llama)!r}, tensor_parallel_size=2)
            pid = llm.collective_rpc(lambda w: os.getpid())[1]
            threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
            start = time.monotonic()
            try:
                for _ in range(1000):
                    llm.generate(TokensPrompt(prompt_token_ids=[5] * 9),
                                 SamplingParams(max_tokens=8, ignore_eos=True),
                                 use_tqdm=False)
            except Exception as exc:
                # One write, on a line of its own: the engine's log lines
                # share stdout and are written from other threads.
                os.write(1, (f"\\nFAILED-FAST {{time.monotonic() - start:.1f}} "
                             f"{{type(exc).__name__}} {{str(exc)[:200]}}\\n"
                             ).encode())
                os._exit(0)
            os.write(1, b"\\nNO-ERROR\\n")
            os._exit(0)
    """))
    env = dict(os.environ, **spyre_env("eager", [64], [8], [1]))
    proc = subprocess.run([sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    line = [ln for ln in proc.stdout.splitlines()
            if ln.startswith(("FAILED-FAST", "NO-ERROR"))]
    assert line and line[0].startswith("FAILED-FAST"), proc.stdout[-2000:] + \
        proc.stderr[-3000:]
    assert float(line[0].split()[1]) < 30
    assert "rank(s) [1] died" in line[0]


def test_ray_backend_tp2_on_a_local_cluster(tiny_llama, hf_tiny):
    """A one-machine Ray cluster on loopback that declares two cards."""
    import ray
    ray.init(num_cpus=2, resources={"spyre": 2}, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        with spyre_llm(tiny_llama, spyre_env("eager", **SHAPES),
                       tensor_parallel_size=2,
                       distributed_executor_backend="ray") as llm:
            executor = type(llm.llm_engine.model_executor).__name__
            got = generate(llm)
            llm.llm_engine.model_executor.shutdown()
    finally:
        ray.shutdown()
    assert executor == "RaySpyreExecutor"
    assert got == [hf_tiny.greedy(p, n)[0] for p, n in REQUESTS]



def test_ray_backend_without_a_cluster_starts_a_local_one(tiny_llama, hf_tiny,
                                                          caplog):
    """Nobody ran `ray start`: the executor starts a local Ray instance
    declaring this machine's cards, says so, and stops it at shutdown."""
    import ray
    assert not ray.is_initialized()
    with mock.patch.dict(os.environ, {"RAY_ADDRESS": ""}):
        with spyre_llm(tiny_llama, spyre_env("eager", **SHAPES),
                       tensor_parallel_size=2,
                       distributed_executor_backend="ray") as llm:
            got = generate(llm)
            resources = ray.cluster_resources()
            llm.llm_engine.model_executor.shutdown()
    assert got == [hf_tiny.greedy(p, n)[0] for p, n in REQUESTS]
    assert resources.get("spyre") == 2
    assert any("starting a local Ray instance with 2 Spyre card(s)"
               in r.getMessage() for r in caplog.records)
    assert not ray.is_initialized()


def test_ray_cluster_without_spyre_cards_is_refused(tiny_llama):
    import ray
    ray.init(num_cpus=2, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        with pytest.raises(Exception) as err:
            with spyre_llm(tiny_llama, spyre_env("eager", **SHAPES),
                           tensor_parallel_size=2,
                           distributed_executor_backend="ray"):
                pass
    finally:
        ray.shutdown()
    assert "declares 0 units of the 'spyre' resource" in str(err.value)

def test_card_count_from_environment_must_split_the_heads(smollm2):
    """SmolLM2 has 9 query heads: AIU_WORLD_SIZE=2 is refused up front."""
    from vllm import EngineArgs
    env = dict(spyre_env("eager", **SHAPES), AIU_WORLD_SIZE="2")
    with mock.patch.dict(os.environ, env):
        with pytest.raises(Exception) as err:
            EngineArgs(model=str(smollm2)).create_engine_config()
    assert "attention heads (9)" in str(err.value)
    assert "tensor parallel size (2)" in str(err.value)
