"""Shared fixtures: the installed-code check, tiny random Llama checkpoints,
Spyre engines built under a given environment, and Hugging Face references."""
from __future__ import annotations

import contextlib
import filecmp
import gc
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional
from unittest import mock

import pytest
from tiny_models import build_tiny_family, build_tiny_llama  # noqa: F401

os.environ.setdefault("VLLM_USE_V1", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_DIR = REPO / "models" / "SmolLM2-135M-Instruct"
MINILM_DIR = REPO / "models" / "all-MiniLM-L6-v2"


def pytest_configure(config):
    """Refuses to test a stale install: every module under vllm/ of the
    working tree must be the one installed in site-packages."""
    site = Path(sysconfig.get_paths()["purelib"])
    stale = [
        str(src.relative_to(REPO)) for pattern in ("*.py", "*.cpp")
        for src in (REPO / "vllm").rglob(pattern)
        if not (site / src.relative_to(REPO)).exists()
        or not filecmp.cmp(src, site / src.relative_to(REPO), shallow=False)
    ]
    if stale:
        pytest.exit(
            "The installed Spyre modules differ from the working tree "
            f"({', '.join(stale)}); run the tests with `make test`, which "
            "re-installs the project first.", returncode=3)


# ---- tiny random checkpoints ---------------------------------------------

def build_tiny_fms(max_len: int):
    """A random 2-layer FMS LLaMA (hidden 64, GQA 4/2 heads, vocabulary
    96), for tests of the attention ops without an engine."""
    import torch
    from fms.models.llama import LLaMA, LLaMAConfig
    torch.manual_seed(0)
    model = LLaMA(LLaMAConfig(src_vocab_size=96, emb_dim=64, nheads=4,
                              kvheads=2, nlayers=2, hidden_grow_factor=2.0,
                              max_expected_seq_len=max_len))
    model.reset_parameters()
    model.post_init()
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_2k(tmp_path_factory) -> Path:
    """The tiny Llama with 2,048 positions, for prompts beyond 1,024."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2k"),
                            positions=2048)


@pytest.fixture(scope="session")
def tiny_llama_3kv(tmp_path_factory) -> Path:
    """The tiny Llama with 6/3 heads: splits over 3 ranks."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-3kv"),
                            heads=6, kv_heads=3)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    if not (SMOLLM2_DIR / ".provisioned").exists():
        pytest.fail(f"{SMOLLM2_DIR} is missing: run `make test`, which "
                    "provisions it")
    return SMOLLM2_DIR


# ---- engines ---------------------------------------------------------------

#: The backend label of the pure torch-op path: ``eager`` with
#: ``VLLM_SPYRE_NATIVE_KERNELS=0``.
TORCH_OPS = "eager-torch-ops"


def backend_env(label: str) -> dict:
    """The settings of a backend label: ``eager``, ``inductor`` (both on
    the C++ kernels where they build) or ``TORCH_OPS``."""
    if label == TORCH_OPS:
        return {"VLLM_SPYRE_DYNAMO_BACKEND": "eager",
                "VLLM_SPYRE_NATIVE_KERNELS": "0"}
    return {"VLLM_SPYRE_DYNAMO_BACKEND": label}


def spyre_env(backend: str, prompt_lens, new_tokens, batch_sizes) -> dict:
    join = lambda xs: ",".join(str(x) for x in xs)  # noqa: E731
    return {
        **backend_env(backend),
        "VLLM_SPYRE_WARMUP_PROMPT_LENS": join(prompt_lens),
        "VLLM_SPYRE_WARMUP_NEW_TOKENS": join(new_tokens),
        "VLLM_SPYRE_WARMUP_BATCH_SIZES": join(batch_sizes),
    }


def release_engine() -> None:
    """Tears down what an engine left in this process, so the next one
    starts clean: the process group and every compiled graph."""
    import torch
    from vllm.distributed import (destroy_distributed_environment,
                                  destroy_model_parallel)
    destroy_model_parallel()
    destroy_distributed_environment()
    torch._dynamo.reset()
    gc.collect()


def mode_llm(model: Path, mode: str, backend: str, prompt_lens, new_tokens,
             batch_sizes, max_model_len: int, **kwargs):
    """``spyre_llm`` in static batching (``mode`` ``"static"``: the warm-up
    shapes given) or continuous batching (``"cb"``: ``--max-num-seqs`` the
    largest batch size, ``max_model_len``)."""
    if mode == "static":
        env = spyre_env(backend, prompt_lens, new_tokens, batch_sizes)
    else:
        env = {"VLLM_SPYRE_USE_CB": "1", **backend_env(backend)}
        kwargs = dict(kwargs, max_num_seqs=max(batch_sizes),
                      max_model_len=max_model_len)
    return spyre_llm(model, env, **kwargs)


@contextlib.contextmanager
def spyre_llm(model: Path, env: dict, **kwargs) -> Iterator:
    """A ``vllm.LLM`` on the Spyre backend under ``env``."""
    from vllm import LLM
    with mock.patch.dict(os.environ, env):
        llm = LLM(model=str(model), **kwargs)
    try:
        yield llm
    finally:
        del llm
        release_engine()


@contextlib.contextmanager
def spyre_engine(model: Path, env: dict, **kwargs) -> Iterator:
    """A bare ``LLMEngine`` on the Spyre backend, for stepping by hand."""
    from vllm import EngineArgs, LLMEngine
    with mock.patch.dict(os.environ, env):
        engine = LLMEngine.from_engine_args(
            EngineArgs(model=str(model), **kwargs))
    try:
        yield engine
    finally:
        del engine
        release_engine()


# ---- references ------------------------------------------------------------

class HFReference:
    """Greedy generation with Hugging Face transformers, one prompt at a
    time, no padding: the reference every Spyre output is compared to."""

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32,
                attn_implementation="sdpa").eval()
        except ValueError as e:
            # transformers refuses SDPA for attention it cannot express
            # (GPT-OSS's sinks): its eager attention is the reference.
            if "scaled_dot_product_attention" not in str(e):
                raise
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32,
                attn_implementation="eager").eval()

    def greedy(self, prompt_ids: list[int],
               max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Token ids and their log-probabilities, EOS ignored."""
        import torch
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model.generate(ids,
                                      attention_mask=torch.ones_like(ids),
                                      max_new_tokens=max_new_tokens,
                                      min_new_tokens=0,
                                      do_sample=False,
                                      eos_token_id=None,
                                      pad_token_id=0,
                                      output_logits=True,
                                      return_dict_in_generate=True)
        new = out.sequences[0, len(prompt_ids):].tolist()
        logprobs = [
            torch.log_softmax(step[0].float(), dim=-1)[tok].item()
            for step, tok in zip(out.logits, new)
        ]
        return new, logprobs


def greedy_tokens(llm, prompts: list[list[int]], max_tokens: int):
    """``llm.generate`` of token-id prompts, greedy, EOS ignored."""
    from vllm import SamplingParams, TokensPrompt
    return llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens,
                       ignore_eos=True), use_tqdm=False)


def greedy_requests(llm, requests) -> list[list[int]]:
    """``llm.generate`` of ``(prompt ids, new tokens)`` requests, each with
    its own ``max_tokens``, greedy, EOS ignored: the generated ids."""
    from vllm import SamplingParams, TokensPrompt
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p, _ in requests],
        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
         for _, m in requests], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def model_runner(llm):
    """The driver worker's model runner of an in-process ``LLM``."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


@pytest.fixture(scope="session")
def hf_tiny(tiny_llama) -> HFReference:
    """transformers' greedy reference of the tiny Llama."""
    return HFReference(tiny_llama)


def compile_count() -> int:
    """Frames dynamo has compiled so far in this process (each recompile
    counts once)."""
    from torch._dynamo.utils import counters
    return sum(counters["frames"].values()) + sum(
        counters["stats"].values())


def prompt_logprobs_match_transformers(llm, model_dir, prompt: list[int],
                                       atol: float = 1e-3) -> None:
    """``prompt_logprobs=1`` of ``prompt`` from ``llm`` equal the
    log-softmax of transformers' logits over the whole prompt, at every
    position after the first."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams, TokensPrompt
    (out, ) = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
        use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir,
                                                 dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    n = len(prompt)
    ref = torch.log_softmax(logits, -1)[torch.arange(n - 1),
                                        torch.tensor(prompt[1:])]
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob
                        for i in range(1, n)])
    assert torch.allclose(got, ref, atol=atol), (got - ref).abs().max()


def first_logprob(output) -> Optional[list[float]]:
    """Log-probability vLLM reported for each sampled token."""
    if output.logprobs is None:
        return None
    return [
        step[tok].logprob for step, tok in zip(output.logprobs,
                                               output.token_ids)
    ]
