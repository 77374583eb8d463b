"""The drivers of the engines the offline benchmarks compare, each with
one interface, ``run(prompts) -> Run``: our Spyre engine stepped by hand,
under static batching (``SpyreDriver``), continuous batching
(``SpyreCBDriver``) or with the graph cache (``SpyreGraphCacheDriver``),
Hugging Face ``generate`` (``HFDriver``) and FMS ``generate`` on a
compiled FMS model (``FMSDriver``); llama.cpp's is ``_peers.py``'s.
``_engines.py`` names them and runs them.

Nothing here imports torch, transformers or vLLM at module level: a child
process must be able to set its environment before vLLM is imported.
"""
from __future__ import annotations

import os
import time
from typing import Any, Optional

from spyre_support.bench import Run, Workload
from spyre_support.envs import cb_env, cb_max_model_len, warmup_env


class SpyreDriver:
    """Our vLLM engine (V0 ``LLMEngine``, Spyre platform), stepped by hand,
    with one warm-up shape per batch size; start-up compiles them all."""

    def __init__(self, work: Workload, backend: str,
                 dtype: str = "float32", model_impl: str = "auto") -> None:
        # Before vLLM is first imported (the platform reads it at start-up).
        os.environ.update(self.env(work, backend))
        from vllm import EngineArgs, LLMEngine
        self.work = work
        # No periodic stats logging inside timed steps (vllm.LLM's default).
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(model=work.model, disable_log_stats=True, dtype=dtype,
                       model_impl=model_impl, **self.engine_args(work)))
        self.next_id = 0

    @staticmethod
    def env(work: Workload, backend: str) -> dict[str, str]:
        # Static batching even if the caller's environment says otherwise.
        return dict(warmup_env(backend, [(work.prompt_len, work.new_tokens, b)
                                        for b in work.batch_sizes]),
                    VLLM_SPYRE_USE_CB="0")

    @staticmethod
    def engine_args(work: Workload) -> dict[str, Any]:
        return dict(max_num_seqs=max(work.batch_sizes))

    def weight_bytes(self) -> int:
        """What this rank's model holds in parameters and buffers (packed
        and quantized weights, norms, embeddings; not the KV cache)."""
        worker = self.engine.model_executor.driver_worker.worker
        return unique_parameter_bytes(worker.model_runner.model,
                                      buffers=True)

    def step_bytes(self) -> int:
        """The bytes a batch-1 decode step reads: the weights held
        (``weight_bytes``) less the token embeddings, of which a step reads
        one row per token."""
        worker = self.engine.model_executor.driver_worker.worker
        return decode_read_bytes(worker.model_runner.model)

    def run(self, prompts: list[list[int]]) -> Run:
        from vllm import SamplingParams, TokensPrompt
        ids: dict[int, list[int]] = {}
        started: set[str] = set()  # rows that have their first token
        ttft = None
        scheduler = self.engine.scheduler[0]
        preempted = scheduler.num_cumulative_preemption
        start = time.perf_counter()
        for prompt in prompts:
            self.engine.add_request(
                str(self.next_id), TokensPrompt(prompt_token_ids=prompt),
                SamplingParams(temperature=0, max_tokens=self.work.new_tokens,
                               ignore_eos=True))
            self.next_id += 1
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            started.update(o.request_id for o in outputs
                           if o.outputs and o.outputs[0].token_ids)
            if ttft is None and len(started) == len(prompts):
                ttft = time.perf_counter() - start  # the last prefill step
            for o in outputs:
                if o.finished:
                    ids[int(o.request_id)] = list(o.outputs[0].token_ids)
        total = time.perf_counter() - start
        assert ttft is not None, "some row got no token"
        return Run(ttft, total, [ids[k] for k in sorted(ids)],
                   preemptions=scheduler.num_cumulative_preemption -
                   preempted)


class SpyreCBDriver(SpyreDriver):
    """The same engine under continuous batching: a block pool instead of
    warm-up shapes, ``max_num_seqs`` the largest batch size and
    ``max_model_len`` P + G in whole blocks, so that each of a batch's
    prefills runs alone and then every decode step runs the whole batch,
    as a static shape does.  Start-up compiles the prefill-chunk graph and
    the one decode graph whatever the batch sizes."""

    @staticmethod
    def env(work: Workload, backend: str) -> dict[str, str]:
        return cb_env(backend)

    @staticmethod
    def engine_args(work: Workload) -> dict[str, Any]:
        return dict(max_num_seqs=max(work.batch_sizes),
                    max_model_len=cb_max_model_len(work.prompt_len,
                                                   work.new_tokens))


class _FirstTokenTimer:
    """A transformers streamer (duck-typed: ``generate`` only calls put and
    end) that notes when the first new token arrives; ``generate`` puts the
    prompt first, then one token per step."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: Optional[float] = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HFDriver:
    """Hugging Face transformers ``generate``, greedy, sdpa attention (eager
    for a model transformers runs without it: GPT-OSS's sinks)."""

    def __init__(self, work: Workload, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        self.work = work
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                work.model, dtype=getattr(torch, dtype),
                attn_implementation="sdpa").eval()
        except ValueError as e:
            if "scaled_dot_product_attention" not in str(e):
                raise
            self.model = AutoModelForCausalLM.from_pretrained(
                work.model, dtype=getattr(torch, dtype),
                attn_implementation="eager").eval()
        pad = self.model.generation_config.pad_token_id
        # No EOS at all: it neither stops generation nor is suppressed.
        self.config = GenerationConfig(
            do_sample=False, max_new_tokens=work.new_tokens,
            eos_token_id=None, pad_token_id=0 if pad is None else pad)

    def run(self, prompts: list[list[int]]) -> Run:
        import torch
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        ids = torch.tensor(prompts)  # [B, P]
        # eos_token_id=None again as a keyword: generate() refills a None
        # EOS of generation_config from the model's own config.
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                  generation_config=self.config,
                                  use_model_defaults=False,
                                  eos_token_id=None, streamer=timer)
        total = time.perf_counter() - start
        assert timer.first is not None
        return Run(timer.first - start, total,
                   out[:, self.work.prompt_len:].tolist())

    def weight_bytes(self) -> int:
        return unique_parameter_bytes(self.model)


def load_fms_model(model_dir: str):
    """FMS's float32 model of a Hugging Face folder, with the config
    corrections the Spyre loader applies for its family
    (``spyre_families.fms_model_args``: FMS's own mapping loads some
    families wrong), and FMS's own layers otherwise."""
    import torch
    from fms.models import get_model
    from transformers import AutoConfig

    from vllm.model_executor.models.spyre_families import fms_model_args
    args = fms_model_args(model_dir, AutoConfig.from_pretrained(model_dir))
    return get_model(**args, data_type=torch.float32, device_type="cpu")


class FMSDriver:
    """IBM FMS ``generate`` on the FMS model compiled with ``backend``."""

    def __init__(self, work: Workload, backend: str) -> None:
        import torch
        self.work = work
        # One prefill and one (dynamic-length) decode graph per batch size:
        # more than dynamo's default of 8 graphs per frame.
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, 64)
        model = load_fms_model(work.model)
        model.eval()
        model.requires_grad_(False)
        self.fms_model = model
        self.model = torch.compile(model, backend=backend)

    def run(self, prompts: list[list[int]]) -> Run:
        import torch
        from fms.utils.generation import generate, pad_input_ids
        start = time.perf_counter()
        # All rows have P tokens: no padding, only positions and the
        # causal mask.  [B, P], mask [B, P, P]
        ids, kwargs = pad_input_ids([torch.tensor(p) for p in prompts])
        kwargs["last_n_tokens"] = 1
        with torch.no_grad():
            out, times = generate(
                self.model, ids, max_seq_len=self.work.prompt_len +
                self.work.new_tokens, max_new_tokens=self.work.new_tokens,
                use_cache=True, do_sample=False, timing="per-token",
                extra_kwargs=kwargs)
        total = time.perf_counter() - start
        # times[0] is the prefill step (it excludes the few microseconds
        # of input preparation above).
        return Run(times[0], total, out[:, self.work.prompt_len:].tolist())

    def weight_bytes(self) -> int:
        return unique_parameter_bytes(self.fms_model)


def unique_parameter_bytes(model, buffers: bool = False) -> int:
    """Bytes of the model's weights, each storage once (tied embeddings
    count once); with ``buffers``, its buffers too (our packed and
    quantized weights are buffers)."""
    import itertools
    seen: dict[int, int] = {}
    tensors = itertools.chain(model.parameters(),
                              model.buffers() if buffers else ())
    for p in tensors:
        seen[p.data_ptr()] = max(seen.get(p.data_ptr(), 0),
                                 p.numel() * p.element_size())
    return sum(seen.values())


def decode_read_bytes(model) -> int:
    """Bytes of ``model``'s parameters and buffers, each storage once,
    that a batch-1 decode step reads: not the tables of its embedding
    modules (unless a head shares one)."""
    embedding, other = {}, {}
    for module in model.modules():
        is_embedding = "Embedding" in type(module).__name__
        tensors = list(module.named_parameters(recurse=False)) + list(
            module.named_buffers(recurse=False))
        for _, t in tensors:
            size = t.numel() * t.element_size()
            into = embedding if is_embedding else other
            into[t.data_ptr()] = max(into.get(t.data_ptr(), 0), size)
    return sum(other.values())


class SpyreGraphCacheDriver(SpyreDriver):
    """Our engine with the graph cache on (``TORCH_SENDNN_CACHE_ENABLE=1``,
    a fresh directory): graphs precompiled, weights not frozen into them;
    to compare its steps with the default engine's."""

    @staticmethod
    def env(work: Workload, backend: str) -> dict[str, str]:
        import tempfile
        return dict(SpyreDriver.env(work, backend),
                    TORCH_SENDNN_CACHE_ENABLE="1",
                    TORCH_SENDNN_CACHE_DIR=tempfile.mkdtemp(
                        prefix="bench-graph-cache-"))
