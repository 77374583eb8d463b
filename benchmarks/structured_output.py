"""Cost of structured output: the grammar libraries side by side, and
guided against plain generation in our engine.

Libraries (``--libraries``, no engine): for xgrammar and llguidance,
through vLLM's V1 backends as ``vllm.engine.spyre_structured_output`` uses
them, on the model's tokenizer: the time to read the tokenizer, to
compile a JSON schema the first time and again (xgrammar caches compiled
grammars), and per token of a valid 60-token answer, to fill the mask of
allowed tokens and accept the token (the work added to every step of a
guided sequence).

Compile times (``--compile-times``, no engine): xgrammar's compilation
of ``{"type": "string", "minLength": n}`` for each ``--bounds`` n, through
the Spyre backend as the engine runs it (a child process per grammar,
killed at ``--budget`` seconds), on the model's tokenizer: how long a
bound takes, which ``VLLM_SPYRE_GUIDED_MAX_REPEAT`` and
``VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S`` are set against.

Engine (default): our engine with continuous batching (``--max-num-seqs``
the batch), ``--batch`` requests at once, greedy, ``--new-tokens`` at
most; ``json`` runs the prompts under a JSON schema (a small record with
free text fields), ``plain`` the same prompts as free text, each request
exactly as many tokens as under the schema (EOS ignored), so that both
batches make the same steps.  Output tokens/s is every output token over
the wall time of the batch; medians of ``--repetitions``, alternating.  Any compilation during a timed batch
fails the run.

    python benchmarks/structured_output.py [--model DIR]
        [--backend inductor] [--batch 8] [--new-tokens 96]
        [--repetitions 3] [--json PATH]
    python benchmarks/structured_output.py --libraries [--model DIR]
    python benchmarks/structured_output.py --compile-times [--model DIR]
        [--bounds 64,256,1024] [--budget 120]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Optional

from spyre_support.bench import (Child, add_json_option, benchmark_parser,
                                 build_prompts, machine_info, table, text_ids,
                                 write_json)
from spyre_support.engines import compile_count
from spyre_support.envs import cb_env

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string",
                                            "maxLength": 20},
                 "maxItems": 3},
        "done": {"type": "boolean"},
    },
    "required": ["title", "year", "tags", "done"],
    "additionalProperties": False,
}
ANSWER = {"title": "Serving language models on IBM Spyre cards, fast",
          "year": 2026, "tags": ["spyre", "vllm", "structured output"],
          "done": True}


def backend(name: str, model: str, budget: float = 120.0):
    """The grammar backend of library ``name`` as the engine builds it
    (xgrammar's compiling in a child process within ``budget`` s), and
    the tokenizer."""
    from transformers import AutoTokenizer

    from vllm.engine.arg_utils import EngineArgs
    tokenizer = AutoTokenizer.from_pretrained(model)
    config = EngineArgs(model=model).create_engine_config()
    kwargs = dict(tokenizer=tokenizer,
                  vocab_size=config.model_config.get_vocab_size())
    if name == "xgrammar":
        from vllm.engine.spyre_grammar_compile import BoundedXgrammarBackend
        return BoundedXgrammarBackend(config, timeout_s=budget,
                                      **kwargs), tokenizer
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend
    return GuidanceBackend(config, **kwargs), tokenizer


def compile_times(model: str, bounds: list[int],
                  budget: float) -> tuple[list[list], dict]:
    from vllm.v1.structured_output.backend_types import (
        StructuredOutputOptions)
    xgrammar, _ = backend("xgrammar", model, budget)
    rows, results = [], {}
    for n in bounds:
        spec = json.dumps({"type": "string", "minLength": n})
        start = time.perf_counter()
        try:
            xgrammar.compile_grammar(StructuredOutputOptions.JSON, spec)
            outcome = "compiled"
        except ValueError:
            outcome = f"over the {budget:g} s budget"
        seconds = time.perf_counter() - start
        results[n] = dict(seconds=seconds, outcome=outcome)
        rows.append([f"{n:,}", f"{seconds:.2f}", outcome])
    return rows, results


def libraries(model: str) -> tuple[list[list], dict]:
    from vllm.v1.structured_output.backend_types import (
        StructuredOutputOptions)
    key = (StructuredOutputOptions.JSON, json.dumps(SCHEMA))
    rows, results = [], {}
    for name in ("xgrammar", "guidance"):
        start = time.perf_counter()
        library, tokenizer = backend(name, model)
        setup = time.perf_counter() - start
        answer = tokenizer.encode(
            json.dumps(ANSWER, separators=(",", ":")),
            add_special_tokens=False)
        start = time.perf_counter()
        library.compile_grammar(*key)
        first = time.perf_counter() - start
        start = time.perf_counter()
        grammar = library.compile_grammar(*key)
        again = time.perf_counter() - start
        bitmask = library.allocate_token_bitmask(1)
        start = time.perf_counter()
        for token in answer:
            grammar.fill_bitmask(bitmask, 0)
            assert grammar.accept_tokens("bench", [token]), name
        per_token = (time.perf_counter() - start) / len(answer)
        results[name] = dict(setup_s=setup, compile_first_s=first,
                             compile_again_s=again,
                             per_token_us=per_token * 1e6,
                             tokens=len(answer))
        rows.append([name, f"{setup:.2f}", f"{first * 1000:.1f}",
                     f"{again * 1000:.2f}", f"{per_token * 1e6:.0f}"])
    return rows, results


class Engine:
    """Our engine (continuous batching) in a child process."""

    def __init__(self, model: str, args: dict) -> None:
        from vllm import LLM
        self.llm = LLM(model=model, max_num_seqs=args["batch"],
                       max_model_len=256)
        self.args = args
        self.prompts = build_prompts(text_ids(model), args["batch"], 48)

    def info(self) -> dict:
        return {}

    def run(self, kind: str, lengths: Optional[list[int]] = None) -> dict:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import GuidedDecodingParams
        guided = (GuidedDecodingParams(json=SCHEMA) if kind == "json"
                  else None)
        params = [
            SamplingParams(temperature=0,
                           max_tokens=n or self.args["new_tokens"],
                           ignore_eos=kind == "plain",
                           guided_decoding=guided)
            for n in (lengths or [0] * len(self.prompts))
        ]
        before = compile_count()
        start = time.perf_counter()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in self.prompts],
            params, use_tqdm=False)
        seconds = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        tokens = sum(lengths)
        valid = 0
        if kind == "json":
            for o in outs:
                try:
                    json.loads(o.outputs[0].text)
                    valid += 1
                except ValueError:
                    pass
        return dict(seconds=seconds, tokens=tokens, valid=valid,
                    lengths=lengths,
                    compilations=compile_count() - before)


def main() -> int:
    ap = benchmark_parser(__doc__, backend=True)
    ap.add_argument("--libraries", action="store_true",
                    help="compare the grammar libraries, no engine")
    ap.add_argument("--compile-times", action="store_true",
                    help="xgrammar's compile time per string bound, no "
                    "engine")
    ap.add_argument("--bounds", default="64,256,1024",
                    help="--compile-times: the minLength bounds")
    ap.add_argument("--budget", type=float, default=120.0,
                    help="--compile-times: seconds a compilation may take")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repetitions", type=int, default=3)
    add_json_option(ap, "structured-output.json")
    args = ap.parse_args()
    if args.compile_times:
        bounds = [int(b) for b in args.bounds.split(",")]
        rows, results = compile_times(args.model, bounds, args.budget)
        write_json(args.json, dict(args=vars(args), machine=machine_info(),
                                   compile_times=results))
        print(f"\nmodel {os.path.basename(args.model)}: xgrammar, "
              '{"type": "string", "minLength": n}, a child process each')
        print(table(["minLength", "compile s", "outcome"], rows))
        return 0
    if args.libraries:
        rows, results = libraries(args.model)
        write_json(args.json, dict(args=vars(args), machine=machine_info(),
                                   libraries=results))
        print(f"\nmodel {os.path.basename(args.model)}: a JSON schema, "
              "then a 60-token valid answer token by token")
        print(table(["library", "tokenizer s", "compile ms",
                     "again ms", "mask + accept us/token"], rows))
        return 0
    work = dict(batch=args.batch, new_tokens=args.new_tokens)
    print(f"starting our engine ({args.backend}, continuous batching) ...",
          flush=True)
    child = Child("engine", Engine, args.model, work,
                  env=cb_env(args.backend))
    kinds = ("plain", "json")
    try:
        child.result()
        # A first batch of each, untimed; the schema's lengths set plain's.
        lengths = child.call("run", "json")["lengths"]
        child.call("run", "plain", lengths)
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        for _ in range(args.repetitions):
            runs["json"].append(child.call("run", "json"))
            runs["plain"].append(child.call("run", "plain", lengths))
    finally:
        child.close()
    rows, results = [], {}
    for kind in kinds:
        rate = statistics.median(r["tokens"] / r["seconds"]
                                 for r in runs[kind])
        results[kind] = dict(tokens_per_s=rate, runs=runs[kind])
        last = runs[kind][-1]
        rows.append([kind, f"{rate:.1f}", str(last["tokens"]),
                     f"{last['valid']}/{args.batch}" if kind == "json"
                     else ""])
    ratio = results["json"]["tokens_per_s"] / results["plain"]["tokens_per_s"]
    compiled = sum(r["compilations"] for k in kinds for r in runs[k])
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               results=results, json_over_plain=ratio))
    print(f"\nmodel {os.path.basename(args.model)}, {args.backend}, "
          f"continuous batching, batch {args.batch}, at most "
          f"{args.new_tokens} new tokens, median of {args.repetitions}")
    print(table(["output", "output tok/s", "tokens", "valid JSON"], rows))
    print(f"json / plain: output tok/s {ratio:.2f}x")
    if compiled:
        print(f"FAILED: {compiled} compilation(s) during the timed batches")
    return 1 if compiled else 0


if __name__ == "__main__":
    sys.exit(main())
