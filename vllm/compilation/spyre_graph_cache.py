"""A persistent cache of compiled graphs for the CPU backends.

With ``TORCH_SENDNN_CACHE_ENABLE=1`` and ``eager`` or ``inductor``, every
graph the model runs (a static shape's prefill and decode, continuous
batching's prefill and decode) is compiled ahead of time with
dynamo's precompile (``torch.compile(...).aot_compile``): one artifact holds
the captured graph, its guards and the backend's compiled code.  It is
written to ``TORCH_SENDNN_CACHE_DIR``; the next start deserialises it, with
no dynamo tracing, no AOTAutograd and no code generation.

Layout of the directory::

    DIR/<entry>/key.json               what the entry was built for
    DIR/<entry>/rank<r>-<graph>.graph  one compiled graph of rank r

``<entry>`` is a digest of the key: everything that changes a graph except
the shape, which is in the graph's name (so a new warm-up shape compiles
that shape only).  A graph file is a magic line, a JSON header (entry,
graph, payload size and SHA-256) and the payload; a file that fails any
check is reported and compiled again, never run.  Files are written to a
temporary name and renamed, under a lock on the entry, so ranks and servers
may share one directory.

This module is the store: the key, its digests and the files.  The
callables that load, compile and run the graphs are in
``spyre_compiled_graphs``.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch

from vllm.logger import init_logger
from vllm.spyre_kernels.ops import has_amx_bf16

logger = init_logger(__name__)

MAGIC = b"SPYRE-GRAPH 1\n"
#: The files (under ``vllm/``) whose code changes a compiled graph: the
#: model code graphs are traced from, the kernels they call, the compile
#: set-up, and the settings and platform choices built into them
#: (``CB_BLOCK_SIZE``, the sliding window).  A new module of that kind must
#: be added here (``tests/unit/test_spyre_graph_code.py`` checks that every
#: listed file exists, and that the model code and kernel folders hold no
#: file this list does not name); schedulers, workers and the server's
#: plumbing are not listed: they choose which graph runs, not what it
#: computes.
GRAPH_CODE = (
    # The settings the graphs are built with, and the platform that
    # derives them.
    "config/spyre.py",
    "config/spyre_env_vars.py",
    "platforms/spyre.py",
    "platforms/spyre_modes.py",
    # The compile set-up.
    "compilation/spyre_compile.py",
    "compilation/spyre_compiled_graphs.py",
    "compilation/spyre_graph_cache.py",
    # The C++ kernels and their fake (tracing) implementations.
    "spyre_kernels/ops.py",
    "spyre_kernels/simd.h",
    "spyre_kernels/linear.cpp",
    "spyre_kernels/quant.cpp",
    "spyre_kernels/quant_int16.h",
    "spyre_kernels/attention.cpp",
    "spyre_kernels/cached_attention.cpp",
    "spyre_kernels/elementwise.cpp",
    "spyre_kernels/vllm_elementwise.cpp",
    "spyre_kernels/lora.cpp",
    # LoRA layers' products in the graphs, and the adapter slots.
    "lora/punica_wrapper/spyre_punica.py",
    "lora/spyre_lora.py",
    # Attention.
    "attention/backends/spyre_attn.py",
    "attention/ops/spyre_encoder_attention.py",
    "attention/ops/spyre_fms_registry.py",
    "attention/ops/spyre_kv_layout.py",
    "attention/ops/spyre_paged_cache.py",
    "attention/ops/spyre_paged_inputs.py",
    "attention/ops/spyre_static_cache.py",
    "attention/ops/spyre_torch_ops.py",
    # Layers.
    "model_executor/layers/quantization/spyre_quant.py",
    "model_executor/layers/quantization/spyre_quant_linear.py",
    "model_executor/layers/quantization/spyre_quant_method.py",
    "model_executor/layers/quantization/spyre_quant_schemes.py",
    "model_executor/layers/spyre_fused_ops.py",
    "model_executor/layers/spyre_vllm_fused_ops.py",
    "model_executor/layers/spyre_linear.py",
    "model_executor/layers/spyre_linear_method.py",
    "model_executor/layers/spyre_mamba.py",
    "model_executor/layers/spyre_moe.py",
    # Loading (the model's structure, sharding and packed weights).
    "model_executor/model_loader/spyre_fms_loader.py",
    "model_executor/model_loader/spyre_encoder_loader.py",
    "model_executor/model_loader/spyre_vllm_loader.py",
    # Models.
    "model_executor/models/spyre_causal_lm.py",
    "model_executor/models/spyre_cb_causal_lm.py",
    "model_executor/models/spyre_dtypes.py",
    "model_executor/models/spyre_encoder.py",
    "model_executor/models/spyre_encoder_families.py",
    "model_executor/models/spyre_families.py",
    "model_executor/models/spyre_fms_model_code.py",
    "model_executor/models/spyre_fms_decoder.py",
    "model_executor/models/spyre_gpt_oss.py",
    "model_executor/models/spyre_granite4.py",
    "model_executor/models/spyre_hf_config.py",
    "model_executor/models/spyre_hf_encoder.py",
    "model_executor/models/spyre_model_code.py",
    "model_executor/models/spyre_model_impl.py",
    "model_executor/models/spyre_static_causal_lm.py",
    "model_executor/models/spyre_vllm_model_code.py",
)
#: Files of the model code folders that do not change a graph: the
#: sampler runs on the graphs' logits, weight updates copy new values into
#: a compiled model, the inspection plugin shortens vLLM's start-up, and
#: the ``torch_sendnn`` probe picks a default backend (a part of the key of
#: its own).
NOT_GRAPH_CODE = (
    "compilation/spyre_sendnn.py",
    "model_executor/layers/spyre_sampler.py",
    "model_executor/model_loader/spyre_weight_update.py",
    "model_executor/models/spyre_inspection.py",
    # Start-up's tensor-parallel size check: what may split, not how.
    "model_executor/models/spyre_tp_dims.py",
    # The quantized-checkpoint writer: a tool, never imported when serving.
    "model_executor/layers/quantization/spyre_quant_files.py",
    "model_executor/layers/quantization/spyre_quant_writer.py",
    "model_executor/layers/quantization/spyre_quant_writer_ct.py",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def digest(data: bytes, n: int = 16) -> str:
    return hashlib.sha256(data).hexdigest()[:n]


def weights_identity(model_dir: str) -> str:
    """Names, sizes and modification times of the weight files: cheap, and
    changed by any new checkpoint written over the old one."""
    root = Path(model_dir)
    files = sorted(p for p in root.glob("*") if p.suffix in _WEIGHT_SUFFIXES)
    listing = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
               for p in files]
    return digest("\n".join(listing).encode())


def code_identity() -> str:
    """Digest of this project's code that changes a compiled graph: the
    files of ``GRAPH_CODE``, names and contents."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in GRAPH_CODE:
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:16]


def _version(dist: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def key_parts(*, model: str, hf_config: Any, backend: str,
              options: Mapping[str, Any], tp_size: int,
              dtype: torch.dtype) -> dict[str, str]:
    """Everything a graph depends on besides its shape, as strings, so a
    mismatch can be named part by part."""
    import vllm
    return {
        "model": os.path.abspath(model),
        "model config": digest(hf_config.to_json_string().encode()),
        "weights": weights_identity(model),
        "backend": backend,
        "compile options": json.dumps(
            {k: v for k, v in sorted(options.items()) if not callable(v)}),
        "tensor parallel size": str(tp_size),
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "ibm-fms": _version("ibm-fms"),
        "project": _version("vllm-spyre-intree") + "+" + code_identity(),
        # AMX decides the quantized kernel's row thresholds, arguments of
        # the graphs' calls.
        "cpu": torch.backends.cpu.get_cpu_capability() +
        ("+amx_bf16" if has_amx_bf16() else ""),
    }


class GraphCache:
    """One entry of the cache directory: the graphs of one configuration,
    for one rank."""

    def __init__(self, directory: str, parts: Mapping[str, str],
                 rank: int) -> None:
        self.root = Path(directory)
        self.parts = dict(parts)
        self.entry = digest(json.dumps(self.parts, sort_keys=True).encode())
        self.dir = self.root / self.entry
        self.rank = rank
        #: loaded / compiled / rejected graphs since start.
        self.stats: Counter = Counter()
        self.writable = True
        self._quiet_now = False
        self._open()

    # ---- the entry ------------------------------------------------------
    def _open(self) -> None:
        if (self.dir / "key.json").is_file():
            logger.info("Spyre graph cache: entry %s in %s", self.entry,
                        self.root)
            self._probe_writable()
            return
        logger.info("Spyre graph cache: %s", self.explain_miss())
        self._write(self.dir / "key.json",
                    json.dumps(self.parts, indent=1, sort_keys=True).encode())

    def _probe_writable(self) -> None:
        try:
            with tempfile.TemporaryFile(dir=self.dir):
                pass
        except OSError as e:
            self._cannot_write(e)

    @contextlib.contextmanager
    def kernels(self) -> Iterator[None]:
        """Inductor's compiled kernels go to (and come from) ``DIR/inductor``
        while a graph is loaded or compiled: a saved graph holds its C++
        source, and building it again takes most of a shape's compile
        (docs/performance.md, "Costs behind the design").  With a
        read-only directory inductor keeps its own cache directory."""
        if not self.writable:
            yield
            return
        from torch._inductor.runtime.cache_dir_utils import \
            temporary_cache_dir
        with temporary_cache_dir(str(self.root / "inductor")):
            yield

    def explain_miss(self) -> str:
        """One line: no entry for this key, and what differs in the
        closest other entry the directory holds."""
        best: Optional[dict] = None
        best_score = (-1, -1)
        for other in sorted(self.root.glob("*/key.json")):
            if other.parent.name == self.entry:
                continue
            try:
                parts = json.loads(other.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(parts, dict):
                continue
            same = sum(parts.get(k) == v for k, v in self.parts.items())
            score = (int(parts.get("model") == self.parts["model"]), same)
            if score > best_score:
                best, best_score = parts, score
        if best is None:
            return (f"{self.root} holds no entry yet; every graph will be "
                    "compiled and kept")
        changed = [
            f"{k} ({best.get(k, 'unset')} -> {v})"
            for k, v in self.parts.items() if best.get(k) != v
        ]
        return (f"no entry in {self.root} for this configuration; the "
                f"closest differs in {', '.join(changed)}: compiling")

    def path(self, graph: str) -> Path:
        return self.dir / f"rank{self.rank}-{graph}.graph"

    # ---- graphs ---------------------------------------------------------
    def read(self, graph: str) -> Optional[bytes]:
        """The payload of ``graph``; None if absent or failing a check
        (reported)."""
        path = self.path(graph)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            return self.reject(graph, f"cannot be read ({e})")
        if not data.startswith(MAGIC):
            return self.reject(graph, "is not a Spyre graph file")
        head_end = data.find(b"\n", len(MAGIC))
        try:
            head = json.loads(data[len(MAGIC):head_end])
        except ValueError:
            return self.reject(graph, "has a corrupt header")
        if head.get("entry") != self.entry or head.get("graph") != graph:
            return self.reject(
                graph, f"belongs to another configuration (entry "
                f"{head.get('entry')}, graph {head.get('graph')})")
        payload = data[head_end + 1:]
        if (len(payload) != head.get("bytes")
                or digest(payload, 64) != head.get("sha256")):
            return self.reject(
                graph, f"is truncated or corrupt ({len(payload)} of "
                f"{head.get('bytes')} bytes, or a checksum mismatch)")
        return payload

    def has(self, graph: str) -> bool:
        """True if ``graph`` is present and passes the file checks."""
        if not self.path(graph).is_file():
            return False
        with self._quiet():
            return self.read(graph) is not None

    def write(self, graph: str, payload: bytes) -> None:
        head = json.dumps({
            "entry": self.entry,
            "graph": graph,
            "bytes": len(payload),
            "sha256": digest(payload, 64)
        }).encode()
        self._write(self.path(graph), MAGIC + head + b"\n" + payload)

    def reject(self, graph: str, why: str) -> None:
        """Counts and reports a graph file that cannot be used (silently
        while ``has`` only looks)."""
        if self._quiet_now:
            return None
        self.stats["rejected"] += 1
        logger.warning("Spyre graph cache: %s %s; compiling the graph again",
                       self.path(graph), why)
        return None

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        self._quiet_now = True
        try:
            yield
        finally:
            self._quiet_now = False

    def _write(self, path: Path, data: bytes) -> None:
        """Atomic write under the entry's lock; a failure (read-only
        directory, full disk) is reported once and serving goes on."""
        if not self.writable:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with self._lock():
                fd, tmp = tempfile.mkstemp(dir=path.parent,
                                           prefix=f".{path.name}.")
                try:
                    # mkstemp's 0600 would hide the file from servers
                    # running as other users.
                    os.fchmod(fd, 0o644)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
        except OSError as e:
            self._cannot_write(e)

    def _cannot_write(self, error: OSError) -> None:
        self.writable = False
        logger.warning(
            "Spyre graph cache: cannot write to %s (%s); serving goes on, "
            "but what this start compiles is not kept", self.dir, error)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        with open(self.dir / ".lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
