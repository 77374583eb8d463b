"""How close each quantized format stays to our bfloat16 engine:
teacher-forced top-1 agreement on real text.

N prompts of P tokens are cut from the benchmark text, spread over all of
it.  Every engine (ours in bfloat16 on the model, then ours on the model
quantized to each format by ``scripts/quantize.py``, the output head
included, as ``offline.py``'s quantized engines run it) reads each prompt
once with prompt log-probabilities (``prompt_logprobs=1``) and generates
one token: at every position it names its top-1 next token given the
text before it.  The script counts, per format, the positions where that
token equals the bfloat16 engine's: N x P positions (N x (P - 1) inside
the prompts plus each prompt's first generated token).

    python benchmarks/quant_quality.py [--model DIR]
        [--formats gptq-int8,fp8,fp8-dynamic,w8a16,gptq-int4,w4a16]
        [--prompts 16] [--prompt-len 64] [--backend eager]
"""
from __future__ import annotations

import os
import sys

from _common import (Child, add_json_option, benchmark_parser,
                     build_prompts, machine_info, spyre_env, table, text_ids,
                     write_json)
from _engines import QUANT_FORMATS, quantized_model

#: The bar the 8-bit formats must clear (docs/quantization.md).
EIGHT_BIT_MIN = 0.97


class TopOne:
    """Lives in a child process: one engine, its top-1 token at every
    position of each prompt and after it."""

    def __init__(self, model: str, backend: str, prompt_len: int,
                 batch: int) -> None:
        os.environ.update(spyre_env(backend, [(prompt_len, 2, batch)]),
                          VLLM_SPYRE_USE_CB="0")
        from vllm import LLM
        self.llm = LLM(model=model, dtype="bfloat16", max_num_seqs=batch,
                       disable_log_stats=True)

    def run(self, prompts: list[list[int]]) -> list[list[int]]:
        from vllm import SamplingParams, TokensPrompt
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                           prompt_logprobs=1), use_tqdm=False)
        tops = []
        for out in outs:
            row = [next(t for t, lp in step.items() if lp.rank == 1)
                   for step in out.prompt_logprobs[1:]]
            tops.append(row + [out.outputs[0].token_ids[0]])
        return tops


def top_one(model: str, backend: str, prompts: list[list[int]],
            batch: int) -> list[list[int]]:
    """``TopOne`` of ``model`` in a fresh process."""
    child = Child(os.path.basename(model), TopOne, model, backend,
                  max(len(p) for p in prompts), batch)
    try:
        child.result()
        return child.call("run", prompts)
    finally:
        child.close()


def agreement(reference: list[list[int]],
              other: list[list[int]]) -> tuple[int, int]:
    """(positions where both name the same token, positions)."""
    pairs = [(a, b) for ra, rb in zip(reference, other)
             for a, b in zip(ra, rb)]
    return sum(a == b for a, b in pairs), len(pairs)


def measure(model: str, formats: list[str], prompts: list[list[int]],
            backend: str = "eager", batch: int = 4) -> dict[str, tuple]:
    """Format -> (agreeing positions, positions) against bfloat16."""
    reference = top_one(model, backend, prompts, batch)
    return {fmt: agreement(reference,
                           top_one(quantized_model(model, fmt), backend,
                                   prompts, batch))
            for fmt in formats}


def real_prompts(model: str, count: int, prompt_len: int) -> list[list[int]]:
    """``count`` windows of ``prompt_len`` tokens spread over the text."""
    ids = text_ids(model)
    stride = max(1, (len(ids) - prompt_len) // max(1, count - 1))
    return build_prompts(ids, count, prompt_len, stride)


def main() -> int:
    ap = benchmark_parser(__doc__, backend=True)
    ap.set_defaults(backend="eager")
    ap.add_argument("--formats", default=",".join(QUANT_FORMATS))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    add_json_option(ap, "quant_quality.json")
    args = ap.parse_args()
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in QUANT_FORMATS]
    if unknown:
        ap.error(f"unknown format(s) {unknown}: {list(QUANT_FORMATS)}")
    prompts = real_prompts(args.model, args.prompts, args.prompt_len)
    found = measure(args.model, formats, prompts, args.backend)
    rows, ok = [], True
    for fmt, (same, total) in found.items():
        bar = QUANT_FORMATS[fmt] == "8-bit"
        passed = not bar or same / total >= EIGHT_BIT_MIN
        ok &= passed
        rows.append([fmt, QUANT_FORMATS[fmt], f"{same}/{total}",
                     f"{100 * same / total:.2f} %",
                     (">= 97 %: " + ("yes" if passed else "NO"))
                     if bar else "-"])
    print(f"model {os.path.basename(args.model.rstrip('/'))}, backend "
          f"{args.backend}, {args.prompts} prompts x {args.prompt_len} "
          "tokens: top-1 next token equal to ours in bfloat16 "
          "(teacher-forced)")
    print(table(["format", "bits", "positions", "agreement", "8-bit bar"],
                rows))
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               agreement={f: dict(same=s, positions=n)
                                          for f, (s, n) in found.items()}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
