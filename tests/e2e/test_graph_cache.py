"""The compiled-graph cache (``TORCH_SENDNN_CACHE_ENABLE=1``), end to end:
every start runs in a process of its own (``spyre_support.engine_start``,
forked from a server that has imported torch and vLLM and compiled
nothing: ``spyre_support.preloaded``), so a warm start can only skip
compiling through the cache directory.

* a cold start compiles and keeps every graph; a warm start loads them all,
  compiles nothing (dynamo's counters and the cache's own), and gives the
  same ids as transformers: static on ``inductor`` and ``eager``, CB,
  TP=3 (every rank), and vLLM's model code, whose graphs are its own;
* a truncated graph file, a file of another model, and a read-only
  directory each give a warning and a working start with the same ids;
* strict mode (``VLLM_SPYRE_REQUIRE_PRECOMPILED=1``) refuses to start
  before compiling anything, naming the shapes missing, and starts when
  the cache holds them all.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spyre_support import preloaded
from spyre_support.envs import cb_env, spyre_env
from spyre_support.reference import HFReference

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [16]]
MAX_TOKENS = 8
# One shape (three prompts: a full batch, then one row and a padding row):
# a prefill and a decode graph per rank.
SHAPES = dict(prompt_lens=[64], new_tokens=[MAX_TOKENS], batch_sizes=[2])
GRAPHS = 2
CB_ARGS = {"max_model_len": 256, "max_num_seqs": 4}
START_TIMEOUT = 600


def start(model: Path, cache: Path, env: dict, engine_args: dict = None,
          strict: bool = False, prefix: tuple = (),
          expect_ok: bool = True) -> dict:
    """One engine start in a fresh process; its RESULT and its log."""
    run_env = dict(os.environ, **env, TORCH_SENDNN_CACHE_ENABLE="1",
                   TORCH_SENDNN_CACHE_DIR=str(cache),
                   VLLM_SPYRE_REQUIRE_PRECOMPILED="1" if strict else "0")
    argv = ["-m", "spyre_support.engine_start", str(model),
            json.dumps(engine_args or {}), json.dumps(PROMPTS), str(MAX_TOKENS)]
    if prefix:  # a command around the interpreter: a process of its own
        proc = subprocess.run([*prefix, sys.executable, *argv], env=run_env,
                              capture_output=True, text=True,
                              timeout=START_TIMEOUT)
    else:
        proc = preloaded.run(argv, env=run_env, timeout=START_TIMEOUT)
    log = proc.stdout + proc.stderr
    if not expect_ok:
        assert proc.returncode != 0, log[-3000:]
        return dict(log=log)
    assert proc.returncode == 0, log[-5000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return dict(json.loads(line[len("RESULT "):]), log=log)


def graph_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/*.graph"))


@pytest.fixture(scope="module")
def hf_ids(tiny_llama):
    hf = HFReference(tiny_llama)
    return [hf.greedy(p, MAX_TOKENS)[0] for p in PROMPTS]


def assert_warm(run: dict, graphs_per_rank: int, ranks: int = 1) -> None:
    assert run["startup_compiles"] == 0, run["log"][-3000:]
    assert run["serving_compiles"] == 0
    assert run["graphs"] == [{"loaded": graphs_per_rank}] * ranks


@pytest.fixture(scope="module")
def static_cache(tmp_path_factory, tiny_llama, hf_ids):
    """A cold inductor start, which fills the cache."""
    cache = tmp_path_factory.mktemp("graph-cache-static")
    env = spyre_env("inductor", **SHAPES)
    cold = start(tiny_llama, cache, env)
    assert cold["ids"] == hf_ids
    assert cold["graphs"] == [{"compiled": GRAPHS}]
    assert len(graph_files(cache)) == GRAPHS
    return cache, env


def test_warm_start_compiles_nothing_same_ids(static_cache, tiny_llama,
                                              hf_ids):
    cache, env = static_cache
    # Strict mode too: every graph is there, so it starts.
    warm = start(tiny_llama, cache, env, strict=True)
    assert_warm(warm, GRAPHS)
    assert warm["ids"] == hf_ids
    assert "(cached)" in warm["log"]


def test_eager_backend_warm_start(tmp_path, tiny_llama, hf_ids):
    env = spyre_env("eager", **SHAPES)
    cold = start(tiny_llama, tmp_path, env)
    assert cold["graphs"] == [{"compiled": GRAPHS}]
    warm = start(tiny_llama, tmp_path, env)
    assert_warm(warm, GRAPHS)
    assert cold["ids"] == warm["ids"] == hf_ids


def test_continuous_batching_warm_start(tmp_path, tiny_llama, hf_ids):
    env = cb_env("inductor")
    cold = start(tiny_llama, tmp_path, env, CB_ARGS)
    assert cold["graphs"] == [{"compiled": 2}]  # prefill, decode
    warm = start(tiny_llama, tmp_path, env, CB_ARGS, strict=True)
    assert_warm(warm, 2)
    assert cold["ids"] == warm["ids"] == hf_ids


def test_vllm_model_code_warm_start(static_cache, tmp_path, tiny_llama,
                                    hf_ids):
    """vLLM's model code (``--model-impl vllm``) keeps graphs of its own:
    none of the FMS path's is taken for them, and a second start loads
    them all."""
    fms_cache, env = static_cache
    args = {"model_impl": "vllm"}
    shutil.copytree(fms_cache, tmp_path / "mixed")
    cold = start(tiny_llama, tmp_path / "mixed", env, args)
    assert cold["graphs"] == [{"compiled": GRAPHS}]
    warm = start(tiny_llama, tmp_path / "mixed", env, args, strict=True)
    assert_warm(warm, GRAPHS)
    assert cold["ids"] == warm["ids"] == hf_ids


@pytest.fixture(scope="module")
def tp_cache(tmp_path_factory, tiny_llama_3kv):
    cache = tmp_path_factory.mktemp("graph-cache-tp")
    env = spyre_env("inductor", **SHAPES)
    cold = start(tiny_llama_3kv, cache, env, {"tensor_parallel_size": 3})
    assert cold["graphs"] == [{"compiled": GRAPHS}] * 3
    return cache, env, cold


def test_tensor_parallel_warm_start(tp_cache, tiny_llama_3kv):
    cache, env, cold = tp_cache
    warm = start(tiny_llama_3kv, cache, env, {"tensor_parallel_size": 3})
    assert_warm(warm, GRAPHS, ranks=3)
    hf = HFReference(tiny_llama_3kv)
    assert warm["ids"] == cold["ids"] == [
        hf.greedy(p, MAX_TOKENS)[0] for p in PROMPTS
    ]


def copy_cache(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_truncated_graph_file_is_recompiled(static_cache, tmp_path,
                                            tiny_llama, hf_ids):
    cache = copy_cache(static_cache[0], tmp_path / "cache")
    victim = graph_files(cache)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[:len(data) // 2])
    run = start(tiny_llama, cache, static_cache[1])
    assert "is truncated or corrupt" in run["log"]
    assert victim.name in run["log"]
    assert run["graphs"] == [{"loaded": GRAPHS - 1, "rejected": 1,
                              "compiled": 1}]
    assert run["ids"] == hf_ids
    # The recompiled graph was written back whole.
    assert victim.read_bytes() != data[:len(data) // 2]
    assert_warm(start(tiny_llama, cache, static_cache[1]), GRAPHS)


def test_graph_file_of_another_model_is_recompiled(static_cache, tp_cache,
                                                   tmp_path, tiny_llama,
                                                   hf_ids):
    cache = copy_cache(static_cache[0], tmp_path / "cache")
    victim = graph_files(cache)[0]
    # The same graph of the 6-head model (rank 0 of its TP=3 entry).
    foreign = next(f for f in graph_files(tp_cache[0])
                   if f.name == victim.name)
    shutil.copyfile(foreign, victim)
    run = start(tiny_llama, cache, static_cache[1])
    assert "belongs to another configuration" in run["log"]
    assert run["graphs"] == [{"loaded": GRAPHS - 1, "rejected": 1,
                              "compiled": 1}]
    assert run["ids"] == hf_ids


def _read_only_prefix() -> tuple:
    """A command prefix under which this user cannot write a directory
    whose write bits are cleared: nothing for an ordinary user; for root,
    setpriv dropping the capabilities that override permissions."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a read-only "
                    "directory cannot be made")
    return (setpriv, "--bounding-set", "-dac_override,-fowner")


def test_read_only_directory_warns_and_serves(static_cache, tmp_path,
                                              tiny_llama, hf_ids):
    prefix = _read_only_prefix()
    empty = tmp_path / "empty"
    empty.mkdir()
    full = copy_cache(static_cache[0], tmp_path / "full")
    for d in (empty, full, *full.iterdir()):
        d.chmod(0o555)
    try:
        # Empty and read-only: compiles, warns that nothing is kept.
        cold = start(tiny_llama, empty, static_cache[1], prefix=prefix)
        assert "cannot write to" in cold["log"]
        assert cold["graphs"] == [{"compiled": GRAPHS}]
        assert cold["ids"] == hf_ids
        assert not list(empty.iterdir())
        # Filled and read-only: loads everything.
        warm = start(tiny_llama, full, static_cache[1], prefix=prefix)
        assert_warm(warm, GRAPHS)
        assert warm["ids"] == hf_ids
    finally:
        for d in (empty, full, *full.iterdir()):
            d.chmod(0o755)


def test_strict_mode_refuses_with_the_missing_shapes(static_cache, tmp_path,
                                                     tiny_llama):
    cache = copy_cache(static_cache[0], tmp_path / "cache")
    # A second shape the cache has never seen.
    env = spyre_env("inductor", prompt_lens=[64, 128],
                    new_tokens=[MAX_TOKENS, 4], batch_sizes=[2, 2])
    run = start(tiny_llama, cache, env, strict=True, expect_ok=False)
    log = run["log"]
    assert "VLLM_SPYRE_REQUIRE_PRECOMPILED=1: 2 graph(s) are missing" in log
    shape = "(prompt_len=128, new_tokens=4, batch_size=2)"
    assert f"prefill of shape {shape}; decode of shape {shape}" in log
    assert "new_tokens=8" not in log.split("are missing")[1].split("\n")[0]
    # Refused before compiling anything: no graph was added.
    assert len(graph_files(cache)) == GRAPHS
