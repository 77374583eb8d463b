"""Unit tests of vllm/compilation/spyre_graph_cache.py: the
entry key, the graph file checks, atomic locked writes, what a miss names,
and precompiled graphs saved and loaded on a small module (no engine); and
the graph cache's settings in vllm/config/spyre.py."""
from __future__ import annotations

import json
import multiprocessing
import os
import re
from pathlib import Path

import pytest
import torch

from vllm.compilation import spyre_graph_cache as gc
from vllm.compilation.spyre_compiled_graphs import PrecompiledGraphs
from vllm.compilation.spyre_graph_cache import (GraphCache,
                                                MAGIC)
from vllm.compilation import spyre_sendnn
from vllm.config.spyre import SpyreConfig

PARTS = {"model": "/m", "weights": "w1", "backend": "inductor", "dtype": "f"}


@pytest.fixture
def warnings(monkeypatch):
    """Every warning the cache logs, formatted."""
    seen: list[str] = []
    monkeypatch.setattr(gc.logger, "warning",
                        lambda msg, *a: seen.append(msg % a))
    return seen


def test_entry_is_a_digest_of_the_key(tmp_path):
    a = GraphCache(str(tmp_path), PARTS, rank=0)
    b = GraphCache(str(tmp_path), dict(reversed(list(PARTS.items()))), 1)
    c = GraphCache(str(tmp_path), dict(PARTS, dtype="bf16"), rank=0)
    assert a.entry == b.entry != c.entry
    assert json.loads((a.dir / "key.json").read_text()) == PARTS
    assert a.path("decode-b1-c72").name == "rank0-decode-b1-c72.graph"
    assert b.path("decode-b1-c72").name == "rank1-decode-b1-c72.graph"


def test_round_trip_and_has(tmp_path):
    cache = GraphCache(str(tmp_path), PARTS, rank=0)
    assert cache.read("g") is None and not cache.has("g")
    cache.write("g", b"payload \x00\n bytes")
    assert cache.read("g") == b"payload \x00\n bytes"
    assert cache.has("g")
    assert cache.stats["rejected"] == 0
    # Nothing but the graph, the key and the lock is left behind.
    assert sorted(p.name for p in cache.dir.iterdir()) == [
        ".lock", "key.json", "rank0-g.graph"
    ]


@pytest.mark.parametrize("damage, why", [
    (lambda d: d[:len(d) - 3], "is truncated or corrupt"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "is truncated or corrupt"),
    (lambda d: b"not a graph" + d, "is not a Spyre graph file"),
    (lambda d: MAGIC + b"{oops\n" + d, "has a corrupt header"),
])
def test_damaged_file_is_rejected_with_a_warning(tmp_path, warnings, damage,
                                                 why):
    cache = GraphCache(str(tmp_path), PARTS, rank=0)
    cache.write("g", b"x" * 100)
    path = cache.path("g")
    path.write_bytes(damage(path.read_bytes()))
    assert cache.read("g") is None
    assert cache.stats["rejected"] == 1
    assert len(warnings) == 1 and why in warnings[0]
    assert str(path) in warnings[0]
    # has() checks quietly.
    assert not cache.has("g") and len(warnings) == 1


def test_file_of_another_entry_or_graph_is_rejected(tmp_path, warnings):
    ours = GraphCache(str(tmp_path), PARTS, rank=0)
    other = GraphCache(str(tmp_path), dict(PARTS, weights="w2"), rank=0)
    other.write("g", b"theirs")
    other.write("h", b"theirs too")
    ours.path("g").write_bytes(other.path("g").read_bytes())
    assert ours.read("g") is None
    assert "belongs to another configuration" in warnings[-1]
    ours.path("g").write_bytes(other.path("h").read_bytes())
    assert ours.read("g") is None
    assert ours.stats["rejected"] == 2


def test_a_miss_names_what_changed(tmp_path):
    assert "holds no entry yet" in GraphCache(str(tmp_path), PARTS,
                                              0).explain_miss()
    GraphCache(str(tmp_path), dict(PARTS, model="/other", backend="eager"),
               rank=0)
    changed = dict(PARTS, backend="eager", dtype="bf16")
    line = GraphCache(str(tmp_path), changed, rank=0).explain_miss()
    # Of two entries the one of the same model is the closest, though the
    # other differs in fewer parts.
    assert "the closest differs in backend (inductor -> eager), dtype " \
           "(f -> bf16): compiling" in line


def test_unwritable_directory_warns_once_and_goes_on(tmp_path, warnings):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = GraphCache(str(blocker / "graphs"), PARTS, rank=0)
    assert not cache.writable
    assert len(warnings) == 1 and "cannot write to" in warnings[0]
    cache.write("g", b"x")  # ignored, no second warning
    assert cache.read("g") is None and len(warnings) == 1


def test_compiled_kernels_live_in_the_cache_directory(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    outside = cache_dir()
    cache = GraphCache(str(tmp_path), PARTS, rank=0)
    with cache.kernels():
        assert cache_dir() == str(tmp_path / "inductor")
    assert cache_dir() == outside
    blocked = tmp_path / "file"
    blocked.write_text("")
    unwritable = GraphCache(str(blocked / "graphs"), PARTS, rank=0)
    with unwritable.kernels():
        assert cache_dir() == outside


def _hammer(directory: str, n: int, size: int) -> None:
    cache = GraphCache(directory, PARTS, rank=0)
    for i in range(n):
        cache.write("g", bytes([i % 251]) * size)


def test_concurrent_writers_never_leave_a_broken_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    writers = [
        ctx.Process(target=_hammer, args=(str(tmp_path), 30, 1 << 18))
        for _ in range(3)
    ]
    for w in writers:
        w.start()
    cache = GraphCache(str(tmp_path), PARTS, rank=0)
    reads = 0
    while any(w.is_alive() for w in writers):
        if cache.path("g").exists():
            assert cache.read("g") is not None  # whole, never partial
            reads += 1
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert len(cache.read("g")) == 1 << 18
    assert cache.stats["rejected"] == 0
    assert not [p for p in cache.dir.iterdir() if p.name.startswith(".r")]


class Small(torch.nn.Module):

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.relu(self.lin(x)) * scale


def compile_count() -> int:
    from torch._dynamo.utils import counters
    return sum(counters["frames"].values()) + sum(
        counters["stats"].values())


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_precompiled_graphs_are_saved_and_loaded(tmp_path, backend):
    model = Small().eval()
    x, x4 = torch.randn(2, 8), torch.randn(4, 8)
    with torch.no_grad():
        want, want4 = model(x), model(x4)
        first = PrecompiledGraphs(model, backend, None,
                                  GraphCache(str(tmp_path), PARTS, 0))
        assert torch.equal(first("b2", x), want)
        assert torch.equal(first("b4", x4), want4)
        assert dict(first.cache.stats) == {"compiled": 2}

        torch._dynamo.reset()
        before = compile_count()
        again = PrecompiledGraphs(model, backend, None,
                                  GraphCache(str(tmp_path), PARTS, 0))
        assert torch.equal(again("b2", x), want)
        assert torch.equal(again("b4", x4), want4)
        assert dict(again.cache.stats) == {"loaded": 2}
        assert compile_count() == before


def test_saved_graphs_load_after_an_engine_that_froze_weights(tmp_path):
    """An engine without the cache sets dynamo's prepare_freezing for the
    whole process; graphs precompiled later must still take the weights
    as inputs when loaded."""
    model = Small().eval()
    x = torch.randn(2, 8)
    with torch.no_grad(), torch._dynamo.config.patch(prepare_freezing=True):
        PrecompiledGraphs(model, "inductor", None,
                          GraphCache(str(tmp_path), PARTS, 0))("b2", x)
        torch._dynamo.reset()
        again = PrecompiledGraphs(model, "inductor", None,
                                  GraphCache(str(tmp_path), PARTS, 0))
        assert torch.equal(again("b2", x), model(x))
    assert dict(again.cache.stats) == {"loaded": 1}


def test_a_graph_whose_guards_fail_is_compiled_again(tmp_path, warnings):
    model = Small().eval()
    with torch.no_grad():
        PrecompiledGraphs(model, "eager", None,
                          GraphCache(str(tmp_path), PARTS, 0))(
                              "g", torch.randn(2, 8))
        # Same name, other shape: the saved graph's guards refuse it.
        graphs = PrecompiledGraphs(model, "eager", None,
                                   GraphCache(str(tmp_path), PARTS, 0))
        x = torch.randn(3, 8)
        assert torch.equal(graphs("g", x), model(x))
    assert dict(graphs.cache.stats) == {"rejected": 1, "compiled": 1}
    assert "does not match the inputs it serves" in warnings[-1]


def test_weights_identity_follows_the_weight_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    w = tmp_path / "model.safetensors"
    w.write_bytes(b"a" * 10)
    first = gc.weights_identity(str(tmp_path))
    (tmp_path / "README.md").write_text("docs do not count")
    assert gc.weights_identity(str(tmp_path)) == first
    w.write_bytes(b"b" * 11)
    assert gc.weights_identity(str(tmp_path)) != first


def test_key_parts_cover_what_changes_a_graph(tmp_path):
    from transformers import LlamaConfig
    (tmp_path / "model.safetensors").write_bytes(b"w")
    common = dict(model=str(tmp_path), hf_config=LlamaConfig(),
                  options={"freezing": False}, tp_size=1,
                  dtype=torch.float32)
    parts = gc.key_parts(backend="inductor", **common)
    assert set(parts) == {
        "model", "model config", "weights", "backend", "compile options",
        "tensor parallel size", "dtype", "torch", "vllm", "ibm-fms",
        "project", "cpu"
    }
    assert parts["torch"] == torch.__version__
    assert parts["dtype"] == "float32"
    assert gc.key_parts(backend="eager", **common)["backend"] == "eager"
    other = dict(common, tp_size=3, hf_config=LlamaConfig(num_hidden_layers=3))
    changed = gc.key_parts(backend="inductor", **other)
    assert changed["tensor parallel size"] == "3"
    assert changed["model config"] != parts["model config"]
    assert Path(parts["model"]).is_absolute() and os.path.isdir(
        parts["model"])


# ------------------------------------------------ settings (spyre_config)
@pytest.fixture
def no_sendnn(monkeypatch):
    """Behave as on a machine without torch_sendnn, wherever tests run."""
    monkeypatch.setattr(spyre_sendnn, "sendnn_available", lambda: False)


def test_graph_cache_is_off_by_default(no_sendnn):
    cfg = SpyreConfig.from_env(environ={})
    assert cfg.graph_cache_dir is None
    assert cfg.require_precompiled is False
    # The directory alone does not turn it on.
    cfg = SpyreConfig.from_env(environ={"TORCH_SENDNN_CACHE_DIR": "/x"})
    assert cfg.graph_cache_dir is None


def test_graph_cache_on_with_directory_and_strict(no_sendnn, tmp_path):
    cfg = SpyreConfig.from_env(environ={
        "TORCH_SENDNN_CACHE_ENABLE": "1",
        "TORCH_SENDNN_CACHE_DIR": str(tmp_path / "graphs"),
        "VLLM_SPYRE_REQUIRE_PRECOMPILED": "1",
    })
    assert cfg.graph_cache_dir == str(tmp_path / "graphs")
    assert cfg.require_precompiled is True
    assert SpyreConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_graph_cache_default_directory(no_sendnn, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    cfg = SpyreConfig.from_env(environ={"TORCH_SENDNN_CACHE_ENABLE": "1"})
    assert cfg.graph_cache_dir == str(tmp_path / "spyre_graphs")


@pytest.mark.parametrize("env, needle", [
    ({"TORCH_SENDNN_CACHE_ENABLE": "yes"},
     "TORCH_SENDNN_CACHE_ENABLE='yes' is invalid: use 0 or 1"),
    ({"VLLM_SPYRE_REQUIRE_PRECOMPILED": "2"},
     "VLLM_SPYRE_REQUIRE_PRECOMPILED='2' is invalid"),
    ({"VLLM_SPYRE_REQUIRE_PRECOMPILED": "1"},
     "VLLM_SPYRE_REQUIRE_PRECOMPILED=1 needs the graph cache: set "
     "TORCH_SENDNN_CACHE_ENABLE=1"),
    ({"TORCH_SENDNN_CACHE_ENABLE": "1", "TORCH_SENDNN_CACHE_DIR": " "},
     "TORCH_SENDNN_CACHE_DIR is empty"),
])
def test_graph_cache_settings_errors(no_sendnn, env, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        SpyreConfig.from_env(environ=env)


def test_strict_mode_is_refused_with_sendnn(monkeypatch):
    monkeypatch.setattr(spyre_sendnn, "sendnn_available", lambda: True)
    with pytest.raises(ValueError, match="with sendnn the cache is "
                       "torch_sendnn's own"):
        SpyreConfig.from_env(environ={
            "VLLM_SPYRE_DYNAMO_BACKEND": "sendnn",
            "TORCH_SENDNN_CACHE_ENABLE": "1",
            "VLLM_SPYRE_REQUIRE_PRECOMPILED": "1"})


def test_a_cached_graph_is_never_frozen(tmp_path):
    """compile_graphs refuses frozen weights with a graph cache entry: the
    cache keeps weights graph inputs (docs/performance.md)."""
    from vllm.compilation.spyre_compile import compile_graphs
    cache = GraphCache(str(tmp_path), PARTS, rank=0)
    with pytest.raises(ValueError, match="cannot hold frozen weights"):
        compile_graphs(torch.nn.Linear(2, 2), "inductor",
                       cache_size_limit=64, freeze=True, cache=cache)
