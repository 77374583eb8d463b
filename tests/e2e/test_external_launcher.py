"""``distributed_executor_backend="external_launcher"`` on Spyre: under
``torchrun --nproc-per-node 3`` every rank runs its own engine in its own
process (``spyre_support.torchrun_generate``), the three form the
tensor-parallel group, and every rank returns transformers' greedy ids (so
TP=1's), static and continuous batching, with nothing compiled after
warm-up; one rank under plain ``python``; ``worker_extension_cls`` mixed
into the Spyre worker and reached by ``LLM.collective_rpc`` on every rank;
a size that disagrees with the launcher is refused; new weights loaded in
place on every rank (each keeping its shard) give transformers' ids of the
new checkpoint with nothing compiled, ``eager`` and ``inductor``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spyre_support.envs import cb_env, spyre_env
from spyre_support.reference import HFReference
from spyre_support.tiny_models import build_retrained

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [16]]
MAX_TOKENS = 8
SCRIPT = "spyre_support.torchrun_generate"
TIMEOUT = 600


def launch(out: Path, model: Path, env: dict, nproc: int,
           engine_args: dict = None, rpc: str = None,
           update_from: Path = None) -> subprocess.CompletedProcess:
    """Runs ``spyre_support.torchrun_generate`` on ``nproc`` ranks (plain
    ``python`` for one)."""
    from vllm.utils import get_open_port
    out.mkdir(parents=True, exist_ok=True)
    if nproc > 1:
        torchrun = Path(sys.executable).with_name("torchrun")
        prefix = [str(torchrun), "--nproc-per-node", str(nproc),
                  "--master-port", str(get_open_port()), "-m"]
    else:
        prefix = [sys.executable, "-m"]
    run_env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    run_env.update(env)
    return subprocess.run(
        [*prefix, SCRIPT, str(out), str(model), json.dumps(PROMPTS),
         str(MAX_TOKENS), "--engine-args", json.dumps(engine_args or {}),
         *(["--rpc", rpc] if rpc else []),
         *(["--update-from", str(update_from)] if update_from else [])],
        env=run_env, capture_output=True, text=True, timeout=TIMEOUT)


def ranks(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text())
            for r in range(nproc)]


@pytest.fixture(scope="module")
def hf_ids(tiny_llama_3kv):
    hf = HFReference(tiny_llama_3kv)
    return [hf.greedy(p, MAX_TOKENS)[0] for p in PROMPTS]


STATIC = spyre_env("eager", [64], [MAX_TOKENS], [3])
CB = cb_env("eager")


@pytest.mark.parametrize("mode, env, engine_args", [
    ("static", STATIC, {}),
    ("cb", CB, {"max_model_len": 256, "max_num_seqs": 4}),
])
def test_torchrun_three_ranks_match_transformers(tmp_path, tiny_llama_3kv,
                                                 hf_ids, mode, env,
                                                 engine_args):
    if shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("torchrun is missing from the environment")
    proc = launch(tmp_path, tiny_llama_3kv, env, 3, engine_args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    for rank in ranks(tmp_path, 3):
        assert rank["executor"] == "SpyreExternalLauncherExecutor"
        assert rank["ids"] == hf_ids, mode
        assert rank["serving_compiles"] == 0


def test_one_rank_under_plain_python(tmp_path, tiny_llama_3kv, hf_ids):
    proc = launch(tmp_path, tiny_llama_3kv, STATIC, 1)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    (rank, ) = ranks(tmp_path, 1)
    assert rank["executor"] == "SpyreExternalLauncherExecutor"
    assert rank["ids"] == hf_ids


def test_size_that_disagrees_with_the_launcher_is_refused(
        tmp_path, tiny_llama_3kv):
    proc = launch(tmp_path, tiny_llama_3kv, STATIC, 1,
                  {"tensor_parallel_size": 3})
    assert proc.returncode != 0
    assert ("tensor_parallel_size=3, but the launcher started WORLD_SIZE=1 "
            "process(es)") in proc.stderr


def test_worker_extension_is_reached_by_collective_rpc(tmp_path,
                                                       tiny_llama_3kv):
    proc = launch(tmp_path, tiny_llama_3kv, STATIC, 3,
                  {"worker_extension_cls":
                   "spyre_support.worker_extension.ModelProbe"},
                  rpc="spyre_probe")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    probes = [rank["rpc"] for rank in ranks(tmp_path, 3)]
    # One worker per engine: each rank's call reaches its own worker.
    assert [p[0]["rank"] for p in probes] == [0, 1, 2]
    assert {p[0]["model"] for p in probes} == {"SpyreStaticCausalLM"}
    # Each rank holds its own shard of the weights.
    assert len({round(p[0]["weights_sum"], 3) for p in probes}) == 3


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_weights_updated_in_place_on_three_ranks(tmp_path, tiny_llama_3kv,
                                                 hf_ids, backend):
    retrained = build_retrained(tiny_llama_3kv, tmp_path / "retrained")
    hf = HFReference(retrained)
    retrained_ids = [hf.greedy(p, MAX_TOKENS)[0] for p in PROMPTS]
    assert retrained_ids != hf_ids
    env = dict(spyre_env(backend, [64], [MAX_TOKENS], [3]),
               VLLM_SPYRE_INDUCTOR_FREEZING="0")
    proc = launch(tmp_path / "out", tiny_llama_3kv, env, 3,
                  update_from=retrained)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    for rank in ranks(tmp_path / "out", 3):
        assert rank["ids"] == hf_ids
        assert rank["updated_ids"] == retrained_ids
        assert rank["update_compiles"] == 0
