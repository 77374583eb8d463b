"""How close each quantized format stays to our bfloat16 engine:
teacher-forced top-1 agreement on real text, as bf16_quality.py measures
bfloat16 against float32.

N prompts of P tokens are cut from the benchmark text, spread over all of
it, and ours in bfloat16 generates G greedy tokens for each.  Then ours on
the model quantized to each format by ``scripts/quantize.py`` (by default
with the output head left float, the tools' default; ``--quantized-head``:
the head quantized too, as ``offline.py``'s quantized engines run it),
served in float32 so that it computes exactly on its dequantized weights,
reads each prompt and its generated tokens once with prompt
log-probabilities (``prompt_logprobs=1``): at each of the N x G generated
positions it names its top-1 next token given our bfloat16 tokens before
it.  The script counts the positions where that token is the one ours in
bfloat16 chose.

    python benchmarks/quant_quality.py [--model DIR]
        [--formats gptq-int8,fp8,fp8-dynamic,w8a16,gptq-int4,w4a16]
        [--prompts 16] [--prompt-len 64] [--new-tokens 64]
        [--backend eager] [--quantized-head]
"""
from __future__ import annotations

import os
import shutil
import sys

from spyre_support.bench import (Child, add_json_option, benchmark_parser,
                                 build_prompts, machine_info, table, text_ids,
                                 write_json)
from spyre_support.envs import warmup_env
from _engines import QUANT_FORMATS, quantized_model

#: The bar the 8-bit formats must clear (docs/quantization.md).
EIGHT_BIT_MIN = 0.97


class Engine:
    """Lives in a child process: one engine (static batching, one shape
    of ``prompt_len`` + ``new_tokens``)."""

    def __init__(self, model: str, backend: str, prompt_len: int,
                 new_tokens: int, batch: int, dtype: str) -> None:
        os.environ.update(
            warmup_env(backend, [(prompt_len, new_tokens, batch)]),
            VLLM_SPYRE_USE_CB="0")
        from vllm import LLM
        self.llm = LLM(model=model, dtype=dtype, max_num_seqs=batch,
                       disable_log_stats=True)

    def info(self) -> str:
        return "ready"

    def greedy(self, prompts: list[list[int]],
               new_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams, TokensPrompt
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=0, max_tokens=new_tokens,
                           ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def forced(self, prompts: list[list[int]],
               generated: list[list[int]]) -> list[list[int]]:
        """Top-1 next token at every generated position, each seeing the
        prompt and the generated tokens before it (prompt
        log-probabilities of prompt + generated, rank 1), and after the
        last one."""
        from vllm import SamplingParams, TokensPrompt
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p + g[:-1])
             for p, g in zip(prompts, generated)],
            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                           prompt_logprobs=1), use_tqdm=False)
        tops = []
        for p, out in zip(prompts, outs):
            steps = out.prompt_logprobs[len(p):]
            tops.append([next(t for t, lp in s.items() if lp.rank == 1)
                         for s in steps] + [out.outputs[0].token_ids[0]])
        return tops


def in_child(model: str, backend: str, prompt_len: int, new_tokens: int,
             batch: int, dtype: str, method: str, *args):
    """``Engine(...).method(*args)`` in a fresh process."""
    child = Child(os.path.basename(model), Engine, model, backend,
                  prompt_len, new_tokens, batch, dtype)
    try:
        child.result()
        return child.call(method, *args)
    finally:
        child.close()


def agreement(reference: list[list[int]],
              other: list[list[int]]) -> tuple[int, int]:
    """(positions where both name the same token, positions)."""
    pairs = [(a, b) for ra, rb in zip(reference, other)
             for a, b in zip(ra, rb)]
    return sum(a == b for a, b in pairs), len(pairs)


def measure(model: str, formats: list[str], prompts: list[list[int]],
            new_tokens: int = 64, backend: str = "eager", batch: int = 4,
            head: bool = False, scratch: str | None = None
            ) -> dict[str, tuple]:
    """Format -> (agreeing positions, positions): ours in bfloat16
    generates ``new_tokens`` greedy tokens per prompt; each quantized
    checkpoint, served in float32 (exact on its dequantized weights: the
    count measures the format, not bfloat16 rounding on top of it), names
    its top-1 token at each of those positions, teacher-forced.
    ``scratch``: write each checkpoint there and delete it once measured
    (one at a time on disk) instead of keeping them in ``.quantized/``."""
    plen = max(len(p) for p in prompts)
    reference = in_child(model, backend, plen, new_tokens, batch,
                         "bfloat16", "greedy", prompts, new_tokens)
    found = {}
    for fmt in formats:
        path = quantized_model(model, fmt, head, root=scratch)
        found[fmt] = agreement(reference, in_child(
            path, backend, plen + new_tokens, 2, batch, "float32", "forced",
            prompts, reference))
        if scratch:
            shutil.rmtree(path)
    return found


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
    ap.add_argument("--quantized-head", action="store_true",
                    help="the checkpoints offline.py runs, output head "
                    "quantized too (default: float head, the tools' "
                    "default)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    add_json_option(ap, "quant_quality.json")
    args = ap.parse_args()
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in QUANT_FORMATS]
    if unknown:
        ap.error(f"unknown format(s) {unknown}: {list(QUANT_FORMATS)}")
    prompts = real_prompts(args.model, args.prompts, args.prompt_len)
    found = measure(args.model, formats, prompts, args.new_tokens,
                    args.backend, head=args.quantized_head)
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
          "tokens, output head "
          f"{'quantized' if args.quantized_head else 'float'}: top-1 next "
          "token equal to ours in bfloat16 (teacher-forced)")
    print(table(["format", "bits", "positions", "agreement", "8-bit bar"],
                rows))
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               agreement={f: dict(same=s, positions=n)
                                          for f, (s, n) in found.items()}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
