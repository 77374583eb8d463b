"""The declaration of every Spyre environment variable (name, default,
help), and the table ``docs/configuration.md`` shows of them.  Only
``vllm.config.spyre`` parses them (``SpyreConfig.from_env``)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from vllm.compilation import spyre_sendnn
from vllm.config.spyre_warmup_shapes import PROMPT_LEN_MULTIPLE

#: Tokens per key/value block under continuous batching: the card's size.
CB_BLOCK_SIZE = 64


@dataclass(frozen=True)
class EnvVar:
    """Declaration of one environment variable."""

    name: str
    default: Callable[[], str]
    default_doc: str
    help: str


def _default_backend() -> str:
    return "sendnn" if spyre_sendnn.sendnn_available() else "inductor"


def _default_cache_dir() -> str:
    from vllm import envs
    return os.path.join(envs.VLLM_CACHE_ROOT, "spyre_graphs")


SPYRE_ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "VLLM_SPYRE_DYNAMO_BACKEND", _default_backend,
        "`sendnn` where `torch_sendnn` imports, else `inductor`",
        "`torch.compile` backend for the model: `sendnn` (Spyre cards), "
        "`inductor` (compiled CPU code) or `eager` (CPU, no code "
        "generation)."),
    EnvVar(
        "VLLM_SPYRE_WARMUP_PROMPT_LENS", lambda: "64", "`64`",
        "Comma-separated prompt lengths of the warm-up shapes, one per "
        f"shape; each a multiple of {PROMPT_LEN_MULTIPLE}. Static batching "
        "only: ignored, with a warning, under continuous batching."),
    EnvVar(
        "VLLM_SPYRE_WARMUP_NEW_TOKENS", lambda: "20", "`20`",
        "Comma-separated numbers of new tokens of the warm-up shapes, one "
        "per shape. Not read for pooling models (embedding, scoring), "
        "which generate nothing."),
    EnvVar(
        "VLLM_SPYRE_WARMUP_BATCH_SIZES", lambda: "1", "`1`",
        "Comma-separated batch sizes of the warm-up shapes, one per shape. "
        "For pooling models a row of a shape may hold several short texts "
        "(docs/embeddings.md)."),
    EnvVar(
        "VLLM_SPYRE_USE_CB", lambda: "0", "`0`",
        "`1` selects continuous batching with paged attention: requests "
        "join and leave the running batch at every step, keys and values "
        f"live in blocks of {CB_BLOCK_SIZE} tokens, `--max-num-seqs` "
        "sequences decode at once and `--max-model-len` bounds a sequence; "
        "no warm-up shapes are needed. `0` selects static batching over "
        "the warm-up shapes. Pooling models always run on warm-up shapes "
        "and ignore it, with a warning."),
    EnvVar(
        "AIU_WORLD_SIZE", lambda: "", "unset",
        "Number of Spyre cards to split the model over (tensor parallel). "
        "Used when `--tensor-parallel-size` is not given; a different "
        "`--tensor-parallel-size` is an error."),
    EnvVar(
        "SPYRE_DEVICES", lambda: "", "unset",
        "Comma-separated ids of the cards this server may use, one per "
        "rank in order; without `AIU_WORLD_SIZE` its length sets the card "
        "count."),
    EnvVar(
        "TORCH_SENDNN_CACHE_ENABLE", lambda: "0", "`0`",
        "`1` keeps every compiled graph in `TORCH_SENDNN_CACHE_DIR` and "
        "loads it from there at the next start instead of compiling it "
        "again. With `sendnn` the pair is `torch_sendnn`'s own; with "
        "`eager` and `inductor` it turns on this project's graph cache "
        "(see docs/performance.md). `0` compiles at every start."),
    EnvVar(
        "TORCH_SENDNN_CACHE_DIR", _default_cache_dir,
        "`$VLLM_CACHE_ROOT/spyre_graphs` (`~/.cache/vllm/spyre_graphs`)",
        "Directory of the compiled-graph cache; servers and ranks may "
        "share it. Read only when `TORCH_SENDNN_CACHE_ENABLE=1`."),
    EnvVar(
        "VLLM_SPYRE_REQUIRE_PRECOMPILED", lambda: "0", "`0`",
        "`1` refuses to start, listing the shapes missing from the graph "
        "cache, instead of compiling them; needs "
        "`TORCH_SENDNN_CACHE_ENABLE=1` (`eager` and `inductor`)."),
    EnvVar(
        "VLLM_SPYRE_INDUCTOR_FREEZING", lambda: "1", "`1`",
        "`1` lets `inductor` freeze the weights into its graphs as "
        "constants (the fastest steps); `0` keeps them graph inputs, which "
        "new weights loaded in place (`update_weights_in_place`) need. "
        "The graph cache always keeps them inputs."),
    EnvVar(
        "VLLM_SPYRE_NATIVE_KERNELS", lambda: "1", "`1`",
        "`1` runs the linear layers and attention on this project's C++ "
        "kernels on both CPU backends (`eager` and `inductor`) wherever "
        "they build; `0` keeps PyTorch's own ops (MKL/oneDNN products, "
        "attention in torch ops), to compare the two. The card (`sendnn`) "
        "never uses them."),
    EnvVar(
        "VLLM_SPYRE_GUIDED_MAX_REPEAT", lambda: "4096", "`4096`",
        "Structured output: the largest repetition a request's grammar may "
        "unroll (a string's `minLength`/`maxLength`, an array's "
        "`minItems`/`maxItems`, a regex `{n,m}`, nested regex repetitions "
        "multiplied). xgrammar compiles one grammar element per repeat; a "
        "request asking for more is refused with HTTP 400."),
    EnvVar(
        "VLLM_SPYRE_GUIDED_MAX_DEPTH", lambda: "64", "`64`",
        "Structured output: how deep the objects and arrays of a request's "
        "JSON schema may nest (a level of `properties` counts as one); a "
        "deeper schema is refused with HTTP 400."),
    EnvVar(
        "VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S", lambda: "10", "`10`",
        "Structured output: seconds a request's grammar may take to "
        "compile (xgrammar, in a child process of the engine, killed when "
        "the time is up); a request whose grammar takes longer is refused "
        "with HTTP 400. The OpenAI server's engine compiles beside its "
        "steps (the request waits in the queue); `LLM(...)` waits at "
        "`add_request`. A grammar seen before compiles nothing."),
    EnvVar(
        "VLLM_SPYRE_GUIDED_MAX_BYTES", lambda: "1048576", "`1048576` (1 MiB)",
        "Structured output: the largest schema, regex, grammar or choice "
        "list a request may send, in bytes; a larger one is refused with "
        "HTTP 400."),
)
ENV_BY_NAME = {v.name: v for v in SPYRE_ENV_VARS}


def render_env_var_table() -> str:
    """Markdown table of every Spyre environment variable."""
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for var in SPYRE_ENV_VARS:
        rows.append(f"| `{var.name}` | {var.default_doc} | {var.help} |")
    return "\n".join(rows) + "\n"
