"""How tensor-parallel ranks start: from a fork server that preloads the
Spyre workers' modules, each rank's worker built under the environment and
working directory the engine gives it."""
from __future__ import annotations

import importlib.util
import os

from vllm.executor import spyre_multiproc_executor_base as base
from vllm.executor.spyre_executor import SPYRE_RANK_MODULES
from vllm.executor.spyre_multiproc_executor import (
    MultiprocessingSpyreExecutor)
from vllm.platforms import spyre_modes


def test_the_preloaded_modules_are_the_platforms_workers():
    workers = {spyre_modes.SPYRE_STATIC_WORKER_CLS,
               spyre_modes.SPYRE_CB_WORKER_CLS,
               spyre_modes.SPYRE_POOLING_WORKER_CLS}
    assert {w.rsplit(".", 1)[0] for w in workers} == set(SPYRE_RANK_MODULES)
    # The fork server skips a module it cannot import: each must exist.
    assert all(importlib.util.find_spec(m) for m in SPYRE_RANK_MODULES)
    executor = object.__new__(MultiprocessingSpyreExecutor)
    assert executor._rank_preload() == ["vllm.worker.worker_base",
                                        *SPYRE_RANK_MODULES]


def test_spawn_is_kept_when_asked(monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert base.rank_start_method(["vllm.worker.worker_base"]) == "spawn"


def test_default_is_the_fork_server(monkeypatch):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    seen = []
    monkeypatch.setattr("multiprocessing.set_forkserver_preload", seen.append)
    assert base.rank_start_method(["a", "b"]) == "forkserver"
    assert seen == [["a", "b"]]


def test_a_rank_is_built_under_the_engines_environment(monkeypatch,
                                                       tmp_path):
    built = []

    def worker(vllm_config, rpc_rank):
        built.append((vllm_config, rpc_rank, dict(os.environ), os.getcwd()))
        return "worker"

    monkeypatch.setattr(base, "WorkerWrapperBase", worker)
    monkeypatch.setenv("LEFT_BY_THE_FORK_SERVER", "1")
    monkeypatch.chdir(os.getcwd())
    env = {"OMP_NUM_THREADS": "3", "MASTER_PORT": "12345"}
    factory = base.RankWorkerFactory(env, str(tmp_path))
    saved = dict(os.environ)
    try:
        assert factory("config", 2) == "worker"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    [(config, rank, seen_env, cwd)] = built
    assert (config, rank, cwd) == ("config", 2, str(tmp_path))
    assert seen_env == env


def test_the_in_process_worker_starts_under_the_rank_environment(
        monkeypatch):
    """SpyreExecutor (one card, in the caller's process): the worker starts
    under the rank's rendezvous address and threads, and the caller gets
    its environment back after, a variable it had set included."""
    from vllm.executor import spyre_executor
    from vllm.executor.uniproc_executor import UniProcExecutor
    seen = []
    monkeypatch.setattr(UniProcExecutor, "_init_executor",
                        lambda self: seen.append(dict(os.environ)))
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setattr(spyre_executor, "get_open_port", lambda: 23456)
    executor = object.__new__(spyre_executor.SpyreExecutor)
    monkeypatch.setattr(spyre_executor.SpyreExecutor, "parallel_config",
                        type("P", (), {"world_size": 1})(), raising=False)
    monkeypatch.setattr(spyre_executor.SpyreExecutor, "spyre_config",
                        type("S", (), {"devices": ["0"]})())
    before = dict(os.environ)
    executor._init_executor()
    [inside] = seen
    assert (inside["MASTER_ADDR"], inside["MASTER_PORT"],
            inside["OMP_NUM_THREADS"], inside["SPYRE_DEVICE"]) == (
                "127.0.0.1", "23456", "7", "0")
    assert dict(os.environ) == before


def test_tensor_parallel_ranks_start_under_their_environments(monkeypatch):
    """MultiprocessingSpyreExecutor in the caller's process (an in-process
    LLM): each rank's process is started with its own rendezvous variables
    and card and with the start method vLLM's wrapper reads; rank 0, which
    runs here, starts under its own; the caller gets its environment back
    after, neither the start method nor rank 0's variables left in it."""
    from vllm.executor import spyre_executor
    started, ran = [], []

    class Wrapper:
        def __init__(self, handler, factory, vllm_config, rank):
            started.append((rank, factory.env,
                            os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")))
            self.process = type("Process", (), {"pid": 1000 + rank})()

    class Thread:
        def __init__(self, *args):
            pass

        def start(self):
            pass

        def close(self):
            # The executor's shutdown closes its monitor.
            pass

    class Results(Thread):
        # Its queue takes the start method from the environment too.
        def __init__(self):
            started.append(("results", None, os.environ.get(
                "VLLM_WORKER_MULTIPROC_METHOD")))

    monkeypatch.setattr(base, "ProcessWorkerWrapper", Wrapper)
    monkeypatch.setattr(base, "ResultHandler", Results)
    monkeypatch.setattr(base, "RankMonitor", Thread)
    monkeypatch.setattr(base, "WorkerWrapperBase",
                        lambda vllm_config, rpc_rank: "driver")
    monkeypatch.setattr(base, "rank_start_method", lambda preload:
                        "forkserver")
    monkeypatch.setattr(
        MultiprocessingSpyreExecutor, "_run_workers",
        lambda self, method, *args: ran.append((method, dict(os.environ))))
    monkeypatch.setattr(spyre_executor, "get_open_port", lambda: 23456)
    for name in ("VLLM_WORKER_MULTIPROC_METHOD", "MASTER_ADDR",
                 "MASTER_PORT", "SPYRE_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    parallel = type("P", (), {"world_size": 3,
                              "pipeline_parallel_size": 1})()
    monkeypatch.setattr(MultiprocessingSpyreExecutor, "parallel_config",
                        parallel, raising=False)
    monkeypatch.setattr(MultiprocessingSpyreExecutor, "vllm_config", None,
                        raising=False)
    monkeypatch.setattr(MultiprocessingSpyreExecutor, "spyre_config",
                        type("S", (), {"devices": ["4", "5", "6"]})())
    executor = object.__new__(MultiprocessingSpyreExecutor)
    before = dict(os.environ)
    executor._init_executor()

    assert started[0] == ("results", None, "forkserver")
    assert [(rank, env["SPYRE_DEVICE"], env["MASTER_PORT"], method)
            for rank, env, method in started[1:]] == [
                (1, "5", "23456", "forkserver"),
                (2, "6", "23456", "forkserver")]
    assert [method for method, _ in ran] == [
        "init_worker", "init_device", "load_model"]
    for _, inside in ran:
        assert (inside["MASTER_ADDR"], inside["MASTER_PORT"],
                inside["SPYRE_DEVICE"]) == ("127.0.0.1", "23456", "4")
    assert dict(os.environ) == before
