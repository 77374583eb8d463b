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

os.environ.setdefault("VLLM_USE_V1", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_DIR = REPO / "models" / "SmolLM2-135M-Instruct"


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


# ---- tiny random Llama ---------------------------------------------------

def build_tiny_llama(out_dir: Path, seed: int = 0, heads: int = 4,
                     kv_heads: int = 2) -> Path:
    """A 2-layer Llama (head size 16, GQA 4/2 heads unless told otherwise,
    1024 positions) with random weights large enough that greedy choices are
    far from ties, and a BPE tokenizer trained offline on a small generated
    corpus."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from tokenizers import decoders
    from transformers import (LlamaConfig, LlamaForCausalLM,
                              PreTrainedTokenizerFast)

    words = ("spyre card batch token shape prompt model cache graph compile "
             "serve request decode prefill tensor kernel the a of to in and "
             "is on with for fast slow red green blue one two three").split()
    rng = torch.Generator().manual_seed(seed)
    corpus = [
        " ".join(words[int(i)] for i in torch.randint(
            0, len(words), (12, ), generator=rng)) for _ in range(400)
    ]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.model_max_length = 512
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
        "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=16 * heads,
                         intermediate_size=32 * heads, num_hidden_layers=2,
                         num_attention_heads=heads,
                         num_key_value_heads=kv_heads,
                         max_position_embeddings=1024, initializer_range=0.3,
                         rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         torch_dtype="float32")
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    fast.save_pretrained(out_dir)
    return out_dir


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

def spyre_env(backend: str, prompt_lens, new_tokens, batch_sizes) -> dict:
    join = lambda xs: ",".join(str(x) for x in xs)  # noqa: E731
    return {
        "VLLM_SPYRE_DYNAMO_BACKEND": backend,
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
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()

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


def compile_count() -> int:
    """Frames dynamo has compiled so far in this process (each recompile
    counts once)."""
    from torch._dynamo.utils import counters
    return sum(counters["frames"].values()) + sum(
        counters["stats"].values())


def first_logprob(output) -> Optional[list[float]]:
    """Log-probability vLLM reported for each sampled token."""
    if output.logprobs is None:
        return None
    return [
        step[tok].logprob for step, tok in zip(output.logprobs,
                                               output.token_ids)
    ]
