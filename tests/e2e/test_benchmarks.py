"""The offline benchmark end to end on a small workload: our engine
(eager) under static and under continuous batching, and Hugging Face
generate, each in its own process, alternated; the script must finish with
identical ids, zero compilations in its timed runs, its JSON, its plot,
and its table printed last."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spyre_support import preloaded
from spyre_support.paths import REPO


def test_offline_benchmark_small(tiny_llama, tmp_path):
    """P + G = 65 tokens: the CB engine's max_model_len (P + G in whole
    64-token blocks) is two blocks, and the static prompt is padded (61 ->
    64).  ``spyre-eager-vllm``: the static engine on vLLM's model code
    (what ``--model-impl vllm`` adds beside each engine), the same ids, and
    its decode rate over the FMS engine's.  On the tiny Llama: the script's
    workings do not depend on the model's size (its warm-ups on SmolLM2
    took most of this test's time)."""
    out, png = tmp_path / "offline.json", tmp_path / "plot.png"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "offline.py"),
         "--model", str(tiny_llama), "--engines",
         "spyre-eager,spyre-cb-eager,hf,spyre-eager-vllm",
         "--batch-sizes", "1,2",
         "--prompt-len", "61", "--new-tokens", "4", "--repetitions", "2",
         "--json", str(out), "--plot", str(png)],
        timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["compilations"] == 0
    assert result["ids_match"] is True
    engines = result["engines"]
    hf = engines["hf"]["batches"]
    for name in ("spyre-eager", "spyre-cb-eager"):
        spyre = engines[name]["batches"]
        for b in ("1", "2"):
            assert spyre[b]["ids"] == hf[b]["ids"]
            assert len(spyre[b]["ids"]) == int(b)
            assert all(len(row) == 4 for row in spyre[b]["ids"])
            assert len(spyre[b]["runs"]) == 2
            assert all(r["compiles"] == 0 for r in spyre[b]["runs"])
            assert spyre[b]["median"]["decode_tok_s"] > 0
            assert spyre[b]["ratios"]["decode/hf"] > 0
    for b in ("1", "2"):
        cb = engines["spyre-cb-eager"]["batches"][b]
        static = engines["spyre-eager"]["batches"][b]
        assert cb["ratios"]["cbstep/static"] == pytest.approx(
            static["median"]["decode_tok_s"] / cb["median"]["decode_tok_s"])
        assert "cbstep/static" not in static["ratios"]
        # Every decode step ran the whole batch: nothing was preempted.
        assert [r["preemptions"] for r in cb["runs"]] == [0, 0]
    assert png.stat().st_size > 1000
    # Each engine's resident memory, before the table; ours also report
    # the bytes their model holds.
    assert all(engines[e]["info"]["rss_bytes"] > 0 for e in engines)
    # Served in float32 as stored: the checkpoint's bytes.
    assert engines["spyre-eager"]["info"]["weight_bytes"] == \
        checkpoint_bytes(tiny_llama)
    assert "RSS MiB" in proc.stdout
    last = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(last)
                  if line.startswith("engine "))
    assert "cbstep/static" in last[header] and "preempt" in last[header]
    # header, rule, 4 engines x 2 sizes
    assert len(last) - header == 2 + 8
    for b in ("1", "2"):
        fms = engines["spyre-eager"]["batches"][b]
        ours = engines["spyre-eager-vllm"]["batches"][b]
        assert ours["ids"] == fms["ids"]
        assert ours["ratios"]["decode vllm/fms"] == pytest.approx(
            ours["median"]["decode_tok_s"] / fms["median"]["decode_tok_s"])
    assert "decode vllm/fms" in proc.stdout


def checkpoint_bytes(model) -> int:
    """The bytes of every tensor of a safetensors checkpoint."""
    from safetensors import safe_open
    total = 0
    for path in model.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    return total


def test_speculative_benchmark_small(tiny_llama, tmp_path):
    """benchmarks/speculative.py: plain decoding against n-gram
    speculation, a draft model (the tiny Llama's own first layer) and an
    MLP speculator, on both workloads at two batch sizes; the same tokens
    from all, nothing compiled in the timed runs, a row per workload,
    batch size and method."""
    from spyre_support.tiny_models import build_tiny_mlp_speculator
    draft = tmp_path / "draft"
    subprocess.run([sys.executable,
                    str(REPO / "scripts" / "speculative_checkpoints.py"),
                    "draft", "--model", str(tiny_llama), "--layers", "1",
                    "--out", str(draft)], check=True, cwd=REPO)
    speculator = build_tiny_mlp_speculator(tmp_path / "mlp", tiny_llama)
    out = tmp_path / "speculative.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "speculative.py"),
         "--model", str(tiny_llama), "--backend", "eager",
         "--batch-sizes", "1,2", "--new-tokens", "24", "--repetitions", "1",
         "--draft", str(draft), "--speculator", str(speculator),
         "--json", str(out)],
        timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["compiles"] == 0
    runs = result["runs"]
    assert [(r["workload"], r["batch"], r["method"]) for r in runs] == [
        (w, b, m) for w in ("grounded", "open") for b in (1, 2)
        for m in ("ngram", "draft", "mlp")]
    assert all(r["same_tokens"] and r["plain_tok_s"] > 0
               and r["tok_s"] > 0 for r in runs)
    assert all(r["accepted"] <= r["proposed"] for r in runs)


def test_images_benchmark_small(tmp_path):
    """benchmarks/images.py on the tiny LLaVA-NeXT: Spyre and
    transformers, two image sizes, two batch sizes: time to first token
    and its split, decode rates, nothing compiled in the timed runs."""
    from spyre_support.tiny_vision import build_tiny_llava_next
    model = build_tiny_llava_next(tmp_path / "llava")
    out = tmp_path / "images.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "images.py"), "--model", str(model),
         "--backend", "eager", "--dtype", "float32", "--image-sizes",
         "32x32,64x64", "--batch-sizes", "1,2", "--new-tokens", "8",
         "--repetitions", "1", "--max-model-len", "256", "--json",
         str(out)], timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    for engine in ("spyre", "transformers"):
        for size in ("32x32", "64x64"):
            run = results[engine][size]
            assert run["ttft"] > run["vision tower"] > 0
            assert all(run["decode"][b] > 0 for b in ("1", "2"))
    assert "Spyre/transformers" in proc.stdout


def test_vision_tower_benchmark_small(tmp_path):
    """benchmarks/vision_tower.py on the tiny LLaVA-NeXT: the tower eager
    and compiled, for two tile counts."""
    from spyre_support.tiny_vision import build_tiny_llava_next
    model = build_tiny_llava_next(tmp_path / "llava")
    out = tmp_path / "vision_tower.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "vision_tower.py"), "--model", str(model),
         "--dtype", "float32", "--tiles", "1,3", "--repetitions", "1",
         "--max-model-len", "256", "--json", str(out)], timeout=600,
        cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"1", "3"}
    assert all(r["eager"] > 0 and r["compiled"] > 0 and r["compile"] > 0
               for r in results.values())
    assert "speed-up" in proc.stdout


def test_first_batch_benchmark_small(tiny_llama, tmp_path):
    """benchmarks/first_batch.py: both settings in fresh processes, every
    call timed, nothing compiled after warm-up, JSON and table (on the
    tiny Llama, as the offline benchmark)."""
    out = tmp_path / "first-batch.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "first_batch.py"),
         "--model", str(tiny_llama), "--backend", "eager", "--batch-size", "2",
         "--new-tokens", "4", "--batches", "2", "--json", str(out)],
        timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["results"]
    assert set(result) == {"default", "usage stats on"}
    for r in result.values():
        assert len(r["seconds"]) == 2 and min(r["seconds"]) > 0
        assert r["first_over_rest"] > 0 and r["compilations"] == [0, 0]
    lines = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines)
                  if line.startswith("setting "))
    assert len(lines) - header == 2 + 2


def test_embeddings_benchmark_small(tmp_path):
    """benchmarks/embeddings.py: sentence-transformers in float32 and
    bfloat16 and our engine in both, alternated; nothing compiled, our
    vectors agree with the reference, both ratios reported, JSON, plot
    and table."""
    from spyre_support.paths import MINILM_DIR
    out, png = tmp_path / "embeddings.json", tmp_path / "embeddings.png"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "embeddings.py"),
         "--model", str(MINILM_DIR), "--text-lens", "32", "--batch-sizes",
         "2", "--texts", "4", "--repetitions", "1", "--json", str(out),
         "--plot", str(png)],
        timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["compilations"] == 0 and png.stat().st_size > 0
    (row, ) = result["rows"]
    assert set(row["emb_s"]) == {"st", "st-bfloat16", "spyre-float32",
                                 "spyre-bfloat16"}
    assert set(row["ratio"]) == {"spyre-float32", "spyre-bfloat16"}
    assert set(row["ratio_same_dtype"]) == {"spyre-float32",
                                            "spyre-bfloat16"}
    assert row["min_cosine"]["spyre-float32"] >= 0.9999
    assert row["min_cosine"]["spyre-bfloat16"] >= 0.9999
    lines = proc.stdout.strip().splitlines()
    assert lines[-3].startswith("text tokens") and lines[-1].startswith("32")


def test_hybrid_split_benchmark_small(tmp_path):
    """benchmarks/hybrid_split.py on a tiny Bamba: the decode step split
    between its 2 Mamba-2 layers and its attention layer, both timed."""
    from spyre_support.tiny_models import build_tiny_family
    model = build_tiny_family("bamba", tmp_path / "bamba")
    out = tmp_path / "split.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "hybrid_split.py"),
         "--model", str(model), "--batch-sizes", "1,2", "--new-tokens",
         "4", "--json", str(out)],
        timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["decode_steps"] == 3
        assert (r["mamba_layers"], r["attention_layers"]) == (2, 1)
        assert r["mamba_ms"] > 0 and r["attention_ms"] > 0
        assert r["mamba_ms"] + r["attention_ms"] <= r["step_ms"]
    lines = proc.stdout.strip().splitlines()
    assert lines[-5].startswith("B ") and lines[-2].startswith("2 ")


def test_prefill_benchmark_small(tmp_path):
    """One prompt through our engine on a tiny bfloat16 model, against
    the peak matrix throughput measured first."""
    from spyre_support.tiny_models import build_bf16_valued_llama
    import torch
    model = build_bf16_valued_llama(tmp_path / "bf16", torch.bfloat16)
    out = tmp_path / "prefill.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "prefill.py"),
         "--model", str(model), "--engines", "spyre-eager-bf16",
         "--prompt-len", "64", "--repetitions", "1", "--matrix", "256",
         "--json", str(out)],
        timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["peak_flop_per_s"]) == {"bfloat16", "float32"}
    ours = result["engines"]["spyre-eager-bf16"]
    assert ours["median"]["compiles"] == 0
    assert ours["flop_per_s"] == pytest.approx(
        result["prompt_flops"] / ours["median"]["ttft_s"])
    assert "of bf16 peak" in proc.stdout.strip().splitlines()[-3]


def test_load_time_benchmark_small(tiny_llama, tmp_path):
    """benchmarks/load_time.py: the checkpoint read cold (dropped from the
    page cache) and warm, an engine started after each, the worker's load
    and warm-up times beside the read, JSON and table."""
    out = tmp_path / "load_time.json"
    proc = preloaded.run(
        [str(REPO / "benchmarks" / "load_time.py"),
         "--models", str(tiny_llama), "--dtype", "float32",
         "--json", str(out)],
        timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result, ) = json.loads(out.read_text())["results"]
    size = sum(f.stat().st_size for f in tiny_llama.glob("*.safetensors"))
    assert result["bytes"] == size
    for state in ("cold", "warm"):
        timings = result[state]
        assert 0 < timings["read_s"] and 0 < timings["load_s"]
        assert 0 < timings["warmup_s"] < timings["engine_s"]
    assert f"{tiny_llama.name} (cold)" in proc.stdout
    assert "load/read" in proc.stdout
