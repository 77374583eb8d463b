"""The up-front memory check: refuse a configuration that cannot fit before
any weight is loaded or any graph compiled.

Each worker estimates what its rank will hold once warmed up, and compares
it with its share of the memory this machine lets the process use:

* the process itself, as it stands when the check runs (Python, torch,
  vLLM and FMS imported, the engine built): measured, not guessed;
* the weights, this rank's share under tensor parallelism (the embedding,
  Mamba-2 layers and GPT-OSS's experts stay whole on every rank: the
  families' ``WHOLE_TENSORS``),
  counted from the checkpoint's safetensors headers at the dtypes they
  are held in (``spyre_dtypes``: on the CPU a bfloat16 model holds its
  linear weights in bfloat16, two bytes each, and the rest in float32),
  with the packed copy of a head tied to the embedding, and LoRA adapters'
  slots where ``--enable-lora`` asks for them (``spyre_lora_memory``);
* the key/value caches: static batching keeps one per warm-up shape, each
  ``batch × (prompt + new tokens) × layers × 2 × KV heads × head size``;
  continuous batching needs at least the blocks of one ``max_model_len``
  sequence (the pool takes what is left after that) or exactly the blocks
  of ``--num-gpu-blocks-override``;
* the activations of the largest step (a prefill of a whole shape; under
  continuous batching, of a whole ``max_model_len`` sequence on
  ``inductor``, else a 64-token chunk), and what running the model costs
  beyond its tensors (``RUNTIME_OVERHEAD``: the compiled graphs and the
  allocator's slack, measured by ``benchmarks/memory.py``).

The memory available is the machine's, or the cgroup's limit where that is
lower, times ``--gpu-memory-utilization``, shared by the ranks on this
machine.  The pure functions here take plain values and are unit tested.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from vllm.model_executor.models.spyre_families import (EMBEDDING_NAMES,
                                                       WHOLE_TENSORS)
from vllm.worker import spyre_prompt_logprobs as prompt_logprobs

GiB = 2**30

#: What running the model costs beyond its weights, caches and activations:
#: a fixed part (bytes) and a fraction of the weights: graphs, inductor's
#: packed copies of weights and its compile-time peak, allocator slack.
#: Measured by ``benchmarks/memory.py`` (docs/performance.md): ``eager``
#: on SmolLM2 and on Granite-3.3-2B- and 8B-shaped checkpoints,
#: ``inductor`` on SmolLM2 and the 2B one (0.17 and 0.21 GiB beyond the
#: tensors: its graphs and compile-time peak hardly grow with the
#: weights, which the kernels hold, packed, outside the graphs).  The
#: weights a load replaces (read in float32, then packed) are not part of
#: it: the load gives their memory back (``return_large_buffers``).
RUNTIME_OVERHEAD = {"eager": (GiB // 10, 0.04), "inductor": (GiB // 5, 0.02),
                    "sendnn": (0, 0.25)}


def overhead_bytes(weights: int, backend: str) -> int:
    """``RUNTIME_OVERHEAD`` of ``backend`` for ``weights`` bytes."""
    fixed, fraction = RUNTIME_OVERHEAD[backend]
    return fixed + int(weights * fraction)


@dataclass(frozen=True)
class Checkpoint:
    """Counts of a checkpoint's tensors: floating-point elements, all and
    those kept whole; of them, the linear layers' weights (2-D
    ``.weight`` tensors other than embeddings), which may be held in
    another dtype; and the bytes of the other tensors (a quantized
    checkpoint's codes, zero points and group indices), held as stored."""

    numel: int
    whole_numel: int
    matrix_numel: int = 0
    matrix_whole_numel: int = 0
    code_bytes: int = 0
    code_whole_bytes: int = 0

    @staticmethod
    def _rank(total: int, whole: int, tp: int) -> int:
        return whole + (total - whole) // tp

    def rank_bytes(self, item: int, tp: int,
                   matrix_item: Optional[int] = None) -> int:
        """Bytes of this rank's weights: floating-point ones at ``item``
        bytes per element, the linear weights among them at
        ``matrix_item`` where given, the rest as stored."""
        total = self._rank(self.numel, self.whole_numel, tp) * item
        if matrix_item is not None:
            total -= self.rank_matrices(tp) * (item - matrix_item)
        return total + self._rank(self.code_bytes, self.code_whole_bytes, tp)

    def rank_matrices(self, tp: int) -> int:
        """Elements of this rank's floating-point linear weights."""
        return self._rank(self.matrix_numel, self.matrix_whole_numel, tp)


#: Bytes per element of the safetensors dtypes, and the floating ones.
_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1,
         "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
         "BOOL": 1}
_FLOATS = ("F64", "F32", "F16", "BF16")


def read_checkpoint(model_dir: str) -> Optional[Checkpoint]:
    """Counts from the safetensors headers of ``model_dir`` (nothing but
    the headers is read); ``None`` when it holds no safetensors file."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    numel = whole = matrix = matrix_whole = codes = codes_whole = 0
    for path in files:
        with open(path, "rb") as f:
            (size, ) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for d in info["shape"]:
                n *= d
            # WHOLE_TENSORS: the tensors no rank splits (the families').
            kept_whole = any(w in name for w in WHOLE_TENSORS)
            if info["dtype"] not in _FLOATS:
                nbytes = n * _ITEM.get(info["dtype"], 1)
                codes += nbytes
                codes_whole += nbytes if kept_whole else 0
                continue
            numel += n
            whole += n if kept_whole else 0
            if len(info["shape"]) == 2 and name.endswith(".weight") and \
                    not any(e in name for e in EMBEDDING_NAMES):
                matrix += n
                matrix_whole += n if kept_whole else 0
    return Checkpoint(numel, whole, matrix, matrix_whole, codes, codes_whole)


@dataclass(frozen=True)
class Geometry:
    """What the cache and activation sizes depend on, for one rank."""

    layers: int
    kv_heads: int  # this rank's
    heads: int  # this rank's
    head_size: int
    hidden: int
    intermediate: int  # this rank's
    vocab: int
    item: int  # bytes per element
    kv_item: int = 0  # bytes per cached element, when not ``item``
    #: A hybrid model's Mamba-2 states of one sequence (``spyre_mamba``).
    state_slot_bytes: int = 0
    #: How many ``[heads, tokens, context]`` score tensors the attention
    #: holds at once: one, or with attention sinks (the scores, those
    #: with the sinks' column, their softmax) three, also in a whole
    #: prompt's causal pass, where PyTorch's own attention holds none.
    score_copies: int = 1

    def kv_bytes(self, sequences: int, length: int) -> int:
        return (sequences * length * self.layers * 2 * self.kv_heads *
                self.head_size * (self.kv_item or self.item))

    def activation_bytes(self, rows: int, tokens: int, context: int,
                         scores: bool = True) -> int:
        """Peak live tensors of one step over ``rows × tokens`` new tokens
        attending over ``context`` positions: the residual stream and its
        norm, q/k/v, the attention scores (unless the step's attention
        never holds them all), the MLP's three intermediates, and the
        float32 logits of every row."""
        t = rows * tokens
        per_token = (3 * self.hidden + (self.heads + 2 * self.kv_heads) *
                     self.head_size + 3 * self.intermediate)
        scores = (self.score_copies * rows * self.heads * tokens * context
                  if scores else 0)
        return (t * per_token + scores) * self.item + rows * self.vocab * 4

    def prompt_logprobs_bytes(self, length: int) -> int:
        """The pass over one prompt of ``length`` tokens that asks for
        prompt log-probabilities (``spyre_prompt_logprobs``): its
        activations (PyTorch's CPU attention holds no ``[heads, L, L]``
        scores for a causal pass), then one slice of float32 logits,
        their log-softmax and the comparison that ranks them: the logits
        part does not grow with the prompt.  With attention sinks the
        pass holds its scores (``score_copies``)."""
        scores = self.score_copies > 1
        return (self.activation_bytes(1, length, length, scores=scores) +
                prompt_logprobs.SLICE * self.vocab * (4 + 4 + 1))


@dataclass(frozen=True)
class Estimate:
    """One rank's estimated resident memory, by part."""

    process: int
    weights: int
    kv_cache: int
    activations: int
    overhead: int
    #: The configuration the caches and activations are sized for.
    sized_for: str

    @property
    def total(self) -> int:
        return (self.process + self.weights + self.kv_cache +
                self.activations + self.overhead)

    def describe(self) -> str:
        parts = (("process", self.process), ("weights", self.weights),
                 ("key/value caches", self.kv_cache),
                 ("activations", self.activations),
                 ("runtime", self.overhead))
        return f"{self.total / GiB:.2f} GiB (" + ", ".join(
            f"{name} {size / GiB:.2f}" for name, size in parts) + ")"


def static_estimate(process: int, weights: int, geometry: Geometry,
                    shapes, backend: str) -> Estimate:
    """Static batching: a cache per shape, the largest shape's prefill."""
    kv = sum(geometry.kv_bytes(s.batch_size, s.max_len) for s in shapes)
    # A hybrid model's Mamba-2 states: one slot per row, per batch size.
    kv += geometry.state_slot_bytes * sum({s.batch_size for s in shapes})
    largest = max(shapes, key=lambda s: geometry.activation_bytes(
        s.batch_size, s.prompt_len, s.max_len))
    act = max(geometry.activation_bytes(largest.batch_size,
                                        largest.prompt_len, largest.max_len),
              geometry.prompt_logprobs_bytes(
                  max(s.prompt_len for s in shapes)))
    return Estimate(process, weights, kv, act,
                    overhead_bytes(weights, backend),
                    f"the largest shape {largest} and the caches of "
                    f"{len(shapes)} shape(s)")


def pooling_estimate(process: int, weights: int, geometry: Geometry,
                     shapes, backend: str) -> Estimate:
    """A pooling model: no key/value cache, the largest shape's pass (every
    token attending over its row) and its ``[B, L, L]`` mask."""
    def step(s) -> int:
        return (geometry.activation_bytes(s.batch_size, s.prompt_len,
                                          s.prompt_len) +
                s.batch_size * s.prompt_len * s.prompt_len)

    largest = max(shapes, key=step)
    return Estimate(process, weights, 0, step(largest),
                    overhead_bytes(weights, backend),
                    f"the largest pooling shape (prompt_len="
                    f"{largest.prompt_len}, batch_size={largest.batch_size})")


def cb_estimate(process: int, weights: int, geometry: Geometry,
                blocks: int, block_size: int, max_model_len: int,
                max_num_seqs: int, backend: str, override: bool,
                on_kernel: bool) -> Estimate:
    """Continuous batching: ``blocks`` blocks of the pool, a prefill and a
    decode step of ``max_num_seqs`` sequences.  On the paged C++ kernel
    (``on_kernel``) a prefill is one pass over a whole ``max_model_len``
    sequence, which the kernel scores one query position at a time (no
    ``[heads, L, L]`` scores); elsewhere it runs in chunks of a block,
    each holding its scores."""
    kv = geometry.kv_bytes(blocks, block_size)
    # A hybrid model's Mamba-2 states: a slot per sequence and a spare.
    from vllm.model_executor.layers.spyre_mamba import cb_state_slots
    kv += geometry.state_slot_bytes * cb_state_slots(max_num_seqs)
    if on_kernel:
        prefill = geometry.activation_bytes(1, max_model_len, max_model_len,
                                            scores=False)
    else:
        prefill = geometry.activation_bytes(1, block_size, max_model_len)
    act = max(prefill,
              geometry.activation_bytes(max_num_seqs, 1, max_model_len),
              geometry.prompt_logprobs_bytes(max_model_len))
    pool = (f"--num-gpu-blocks-override {blocks}" if override else
            f"the {blocks} blocks of one sequence of max_model_len="
            f"{max_model_len}")
    return Estimate(process, weights, kv, act,
                    overhead_bytes(weights, backend),
                    f"a pool of {pool} ({block_size} tokens each)")


def memory_limit(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Bytes this process may use: the machine's memory, or its cgroup's
    limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) where lower."""
    import psutil
    limit = psutil.virtual_memory().total
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = Path(cgroup_root, name).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def check(estimate: Estimate, limit: int, utilization: float,
          ranks_here: int) -> None:
    """``ValueError`` naming the estimate, its parts, what it was sized
    for and what is available, when one rank's estimate does not fit its
    share of ``limit × utilization``."""
    share = limit * utilization / ranks_here
    if estimate.total <= share:
        return
    ranks = f" to each of {ranks_here} ranks" if ranks_here > 1 else ""
    raise ValueError(
        f"Not enough memory for this Spyre configuration: sized for "
        f"{estimate.sized_for}, a rank needs about {estimate.describe()}, "
        f"but {share / GiB:.2f} GiB are available{ranks} "
        f"(--gpu-memory-utilization {utilization} of {limit / GiB:.2f} GiB"
        f"). Use smaller or fewer warm-up shapes (or a lower "
        f"--max-model-len), more tensor-parallel ranks, or raise "
        f"--gpu-memory-utilization.")


def process_rss() -> int:
    import psutil
    return psutil.Process(os.getpid()).memory_info().rss


def geometry_of(vllm_config, item: int, kv_item: int = 0) -> Geometry:
    """One rank's ``Geometry`` from vLLM's model config, which knows each
    family's field names (MQA, explicit head sizes, ...)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    text = model.hf_text_config
    # Granite 4's MLP is its shared one (``intermediate_size`` is its
    # experts' width).
    inner = (getattr(text, "shared_intermediate_size", None)
             or getattr(text, "intermediate_size", None)
             or getattr(text, "n_inner", None) or 4 * model.get_hidden_size())
    from vllm.model_executor.layers.spyre_mamba import StateLayout
    states = StateLayout.from_config(text)
    # A hybrid model's Mamba-2 layers hold states, not keys and values.
    return Geometry(layers=model.get_num_layers(parallel) -
                    (states.layers if states else 0),
                    kv_heads=model.get_num_kv_heads(parallel),
                    heads=model.get_num_attention_heads(parallel),
                    head_size=model.get_head_size(),
                    hidden=model.get_hidden_size(),
                    intermediate=-(-inner // parallel.tensor_parallel_size),
                    vocab=model.get_vocab_size(),
                    item=item,
                    kv_item=kv_item,
                    state_slot_bytes=states.slot_bytes() if states else 0,
                    score_copies=3 if _has_sinks(text) else 1)


def _has_sinks(hf_config) -> bool:
    """Whether the decoder family of ``hf_config`` has attention sinks."""
    from vllm.model_executor.models.spyre_families import FAMILIES
    return any(FAMILIES[a].attention_sinks
               for a in getattr(hf_config, "architectures", None) or []
               if a in FAMILIES)


def weights_of(vllm_config, item: int,
               matrix_item: Optional[int] = None) -> int:
    """This rank's weight bytes, the linear layers' weights at
    ``matrix_item`` bytes each where given (and then a head tied to the
    embedding counted once more, for its own packed copy); the checkpoint
    files' size when they are not safetensors."""
    path = vllm_config.model_config.model
    tp = vllm_config.parallel_config.tensor_parallel_size
    counts = read_checkpoint(path)
    if counts is None:
        stored = sum(f.stat().st_size for f in Path(path).glob("*.bin"))
        return stored // tp
    held = counts.rank_bytes(item, tp, matrix_item)
    model = vllm_config.model_config
    if matrix_item is not None and getattr(model.hf_text_config,
                                           "tie_word_embeddings", False):
        held += (model.get_vocab_size() * model.get_hidden_size() *
                 matrix_item)
    return held


def ranks_on_this_machine(world_size: int) -> int:
    """Ranks of the world group running on this machine (a collective on
    the CPU group: every rank calls it)."""
    if world_size == 1:
        return 1
    import socket

    import torch.distributed as dist

    from vllm.distributed import get_world_group
    names: list = [None] * world_size
    dist.all_gather_object(names, socket.gethostname(),
                           group=get_world_group().cpu_group)
    return names.count(socket.gethostname())
