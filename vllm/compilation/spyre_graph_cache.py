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
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import types
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from vllm.spyre_kernels.ops import has_amx_bf16
from vllm.logger import init_logger

logger = init_logger(__name__)

MAGIC = b"SPYRE-GRAPH 1\n"
#: Files whose bytes are the model code the graphs are traced from.
_CODE_SUFFIXES = (".py", ".cpp", ".h")
#: Packages (under ``vllm``) holding the model code graphs are traced from
#: and the settings built into them (``CB_BLOCK_SIZE``).
_MODEL_CODE_DIRS = ("attention", "compilation", "config", "core",
                    "model_executor", "platforms", "spyre_kernels")
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
    """Digest of this project's model code: the Spyre modules and kernels
    under ``vllm/attention``, ``vllm/compilation`` and
    ``vllm/model_executor`` (loader, models, layers, attention ops), and
    the settings under ``vllm/platforms``."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for part in _MODEL_CODE_DIRS:
        for p in sorted((root / part).rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.suffix in _CODE_SUFFIXES and "spyre" in rel:
                h.update(rel.encode())
                h.update(p.read_bytes())
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
        source, and building it again costs ~45 s a SmolLM2 shape.  With a
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


class PrecompiledGraphs:
    """The compiled model when the graph cache is on: one precompiled
    function per graph name, loaded from the cache or compiled (and
    kept) at its first call.

    A loaded graph's guards are checked against its first inputs; a graph
    whose guards fail is compiled again.  Later calls skip the check: the
    graph's name already fixes every shape it guards, and checking the
    guards of every weight costs ~1 ms a step (SmolLM2).
    """

    def __init__(self, model: torch.nn.Module, backend: str,
                 options: Optional[dict], cache: GraphCache) -> None:
        self.model = model
        self.backend = backend
        self.options = options
        self.cache = cache
        self.graphs: dict[str, Callable] = {}

    def __call__(self, graph: str, *args, **kwargs):
        fn = self.graphs.get(graph)
        if fn is not None:
            return fn(self.model, *args, **kwargs)
        # The first call too: kernels may be loaded when first run.
        with self.cache.kernels():
            fn = self._load(graph, args, kwargs)
            if fn is None:
                fn = self._compile(graph, args, kwargs)
            fn.disable_guard_check()
            self.graphs[graph] = fn
            return fn(self.model, *args, **kwargs)

    def _load(self, graph: str, args: tuple, kwargs: dict):
        payload = self.cache.read(graph)
        if payload is None:
            return None
        try:
            from torch._dynamo.aot_compile import AOTCompiledFunction
            fn = AOTCompiledFunction.deserialize(payload)
            # A saved graph does not remember which inputs were marked
            # dynamic; its shape guards (the batch range) still apply.
            args, kwargs = _unmarked((args, kwargs))
            matches = fn.guard_check(self.model, *args, **kwargs)
        except Exception as e:  # a foreign or stale artifact
            return self.cache.reject(graph, f"cannot be loaded ({e!r})")
        if not matches:
            return self.cache.reject(
                graph, "does not match the inputs it serves "
                f"({_guard_failure(fn, self.model, args, kwargs)})")
        self.cache.stats["loaded"] += 1
        return fn

    def _compile(self, graph: str, args: tuple, kwargs: dict):
        from torch._dynamo.aot_compile import AOTCompiledFunction
        options = dict(self.options or {}, guard_filter_fn=_keep_guard)
        # prepare_freezing (set by an engine without the cache earlier in
        # this process) would keep the parameters out of the saved graph's
        # inputs, and the loaded graph could not be called.
        with torch._dynamo.config.patch(enable_aot_compile=True,
                                        prepare_freezing=False):
            compiled = torch.compile(self.model.forward,
                                     backend=self.backend,
                                     fullgraph=True,
                                     dynamic=False,
                                     options=options)
            fn = compiled.aot_compile((args, kwargs))
        self.cache.stats["compiled"] += 1
        try:
            payload = AOTCompiledFunction.serialize(fn).serialized_data
        except Exception as e:
            logger.warning("Spyre graph cache: graph %s cannot be saved "
                           "(%r); it is compiled at every start", graph, e)
        else:
            self.cache.write(graph, payload)
        return fn


def _unmarked(value):
    """``value`` with every tensor marked dynamic (``mark_dynamic``)
    replaced by an unmarked alias of the same data."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "_dynamo_dynamic_indices"):
            return value.detach()
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_unmarked(v) for v in value)
    if isinstance(value, dict):
        return {k: _unmarked(v) for k, v in value.items()}
    return value


def _guard_failure(fn, model, args: tuple, kwargs: dict) -> str:
    """The first failing guard of a precompiled function, in words."""
    f_locals = fn.prepare_f_locals(model, *args, **kwargs)
    reason = fn._artifacts.guard_manager.check_verbose(f_locals)
    return "; ".join(getattr(reason, "verbose_code_parts", [str(reason)]))


def _keep_guard(entries) -> list[bool]:
    """Every guard that can be saved: not those on globals, nor the kinds
    dynamo cannot serialise, nor those on a tensor-parallel process group
    (a live object; the group is fixed by the entry's tensor parallel
    size, and vLLM creates its groups in the same order at every start)."""
    from torch._dynamo.guards import CheckFunctionManager
    from torch.distributed import ProcessGroup
    unsaved = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    groups = tuple(e.name for e in entries
                   if e.has_value and isinstance(e.value, ProcessGroup))
    return [
        not e.is_global and e.guard_type not in unsaved
        and not any(e.name == g or e.name.startswith(g + ".") for g in groups)
        for e in entries
    ]


class DynamoGraphs:
    """The compiled model when the graph cache is off: dynamo picks the
    graph by its guards, so the graph name is not needed.

    ``model.forward`` is compiled through a copy with a code object of its
    own.  Dynamo keeps its graphs per code object, and guards on a model's
    weights by shape and dtype, not identity; a graph with frozen weights
    holds one model's weights as constants.  Without the copy, a second
    model of the same class in the process (an embedder beside a reranker,
    two engines) would run the first one's graphs and weights."""

    def __init__(self, model: torch.nn.Module, **compile_args) -> None:
        self.compiled = torch.compile(own_code(model.forward),
                                      **compile_args)

    def __call__(self, graph: str, *args, **kwargs):
        return self.compiled(*args, **kwargs)


def own_code(method: Callable) -> Callable:
    """``method`` (bound) with a copy of its function's code object."""
    func = method.__func__
    copy = types.FunctionType(func.__code__.replace(), func.__globals__,
                              func.__name__, func.__defaults__,
                              func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return types.MethodType(copy, method.__self__)
