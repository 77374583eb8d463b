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
