"""How close ``--dtype bfloat16`` stays to float32: teacher-forced top-1
agreement of our bfloat16 engine with transformers.

Our engine (static batching, one warm-up shape) generates G greedy tokens
for each of N prompts cut from the benchmark text, spread over all of it.
transformers then runs every generated sequence once in float32 and once in
bfloat16 (teacher forcing: each position sees our tokens before it), and
for every generated position the script compares:

* ours against transformers' float32 argmax: **agreement with float32**;
* transformers' own bfloat16 argmax against its float32 argmax on the same
  positions: what bfloat16 weights cost a reference implementation;
* ours against transformers' bfloat16 argmax at the positions where
  transformers' bfloat16 is *stable*: its top-1 logit leads the top-2 by
  more than twice its own bfloat16 error there (the largest difference of
  its logits from float32).  Elsewhere two correct bfloat16 engines may
  pick different tokens.

    python benchmarks/bf16_quality.py [--model DIR] [--backend inductor]
        [--prompts 16] [--prompt-len 64] [--new-tokens 64] [--batch 8]
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

from spyre_support.bench import (add_json_option, add_shape_options,
                                 benchmark_parser, build_prompts, machine_info,
                                 table, text_ids, write_json)
from spyre_support.engines import compile_count
from spyre_support.envs import warmup_env


def generate(model: str, backend: str, prompts: list[list[int]],
             new_tokens: int, batch: int) -> tuple[list[list[int]], int]:
    """Our greedy ids in bfloat16, and the compilations while serving."""
    prompt_len = max(len(p) for p in prompts)
    os.environ.update(warmup_env(backend, [(prompt_len, new_tokens, batch)]),
                      VLLM_SPYRE_USE_CB="0")
    from vllm import LLM, SamplingParams, TokensPrompt
    llm = LLM(model=model, dtype="bfloat16", max_num_seqs=batch,
              disable_log_stats=True)
    before = compile_count()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=new_tokens,
                                       ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], (compile_count() -
                                                          before)


@dataclass
class Judgement:
    """One sequence, per generated position: our token, transformers'
    bfloat16 and float32 argmax on our prefix, and whether its bfloat16 is
    stable there."""

    ours: list[int]
    bf16: list[int]
    fp32: list[int]
    stable: list[bool]

    def stable_mismatches(self) -> list[int]:
        return [i for i, (s, a, b) in enumerate(
            zip(self.stable, self.ours, self.bf16)) if s and a != b]


class TeacherForced:
    """transformers in float32 and in bfloat16, one sequence at a time, no
    padding (also used by tests/e2e/test_bf16.py)."""

    def __init__(self, model: str, adapter: Optional[str] = None):
        """``adapter``: a LoRA adapter's folder, merged into both."""
        import torch
        from transformers import AutoModelForCausalLM
        self.models = {d: AutoModelForCausalLM.from_pretrained(
            model, dtype=d, attn_implementation="sdpa").eval()
            for d in (torch.float32, torch.bfloat16)}
        if adapter is not None:
            from peft import PeftModel
            self.models = {d: PeftModel.from_pretrained(
                m, adapter).merge_and_unload().eval()
                for d, m in self.models.items()}

    def judge(self, prompt: list[int], ours: list[int]) -> Judgement:
        import torch
        seq = torch.tensor([prompt + ours[:-1]])
        n = len(prompt)
        with torch.no_grad():
            l32, l16 = (self.models[d](seq).logits[0, n - 1:].float()
                        for d in (torch.float32, torch.bfloat16))
        error = (l16 - l32).abs().amax(-1)
        lead = l16.topk(2, dim=-1).values
        stable = (lead[:, 0] - lead[:, 1]) > 2 * error
        return Judgement(ours, l16.argmax(-1).tolist(),
                         l32.argmax(-1).tolist(), stable.tolist())


def judge(model: str, prompts: list[list[int]],
          generated: list[list[int]]) -> dict:
    """Counts over every generated position (see the module docstring)."""
    reference = TeacherForced(model)
    counts = dict(positions=0, ours_fp32=0, hf_bf16_fp32=0, stable=0,
                  stable_ours_hf_bf16=0)
    for prompt, ours in zip(prompts, generated):
        j = reference.judge(prompt, ours)
        counts["positions"] += len(ours)
        counts["ours_fp32"] += sum(a == b for a, b in zip(j.ours, j.fp32))
        counts["hf_bf16_fp32"] += sum(a == b for a, b in zip(j.bf16, j.fp32))
        counts["stable"] += sum(j.stable)
        counts["stable_ours_hf_bf16"] += sum(
            s and a == b for s, a, b in zip(j.stable, j.ours, j.bf16))
    return counts


def main() -> int:
    ap = benchmark_parser(__doc__, backend=True)
    ap.add_argument("--prompts", type=int, default=16)
    add_shape_options(ap)
    ap.add_argument("--batch", type=int, default=8)
    add_json_option(ap, "bf16_quality.json")
    args = ap.parse_args()

    ids = text_ids(args.model)
    # Windows spread over the whole text, so that prompts share as little
    # of it as the text allows.
    stride = max(1, (len(ids) - args.prompt_len) // max(1, args.prompts - 1))
    prompts = build_prompts(ids, args.prompts, args.prompt_len, stride)
    generated, compiles = generate(args.model, args.backend, prompts,
                                   args.new_tokens, args.batch)
    c = judge(args.model, prompts, generated)
    n = c["positions"]

    def pct(k: int, of: int) -> str:
        return f"{k}/{of} = {100 * k / of:.2f} %" if of else "-"

    rows = [
        ("ours bf16 == transformers fp32", pct(c["ours_fp32"], n)),
        ("transformers bf16 == transformers fp32",
         pct(c["hf_bf16_fp32"], n)),
        ("transformers bf16 stable", pct(c["stable"], n)),
        ("ours bf16 == transformers bf16 where stable",
         pct(c["stable_ours_hf_bf16"], c["stable"])),
        ("compilations while serving", str(compiles)),
    ]
    print(f"model {os.path.basename(args.model.rstrip('/'))}, backend "
          f"{args.backend}, {args.prompts} prompts x {args.new_tokens} "
          f"tokens, teacher-forced on our bfloat16 greedy ids")
    print(table(["top-1 agreement", "positions"], rows))
    write_json(args.json, dict(args=vars(args), counts=c, compiles=compiles,
                               machine=machine_info()))
    ok = compiles == 0 and c["stable_ours_hf_bf16"] == c["stable"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
