"""Speculative decoding: decode speed of each method against plain
decoding, on an input-grounded workload and an open-ended one.

One engine per method, each in its own process, all alive, continuous
batching (``--max-num-seqs`` the largest batch): plain decoding; n-gram
lookup, ``--speculative-config '{"method": "ngram",
"num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min":
2}'``; with ``--draft DIR`` a draft model (``{"model": DIR,
"num_speculative_tokens": K}``); with ``--speculator DIR`` an MLP
speculator, the same way (``scripts/speculative_checkpoints.py`` writes
both for a model).  ``--methods`` picks among them.  The prompts go
through the model's chat template:

* input-grounded: instructions whose answer repeats text of the prompt
  (copy a passage, return it with its sentences numbered, list a
  record's fields), over passages of benchmarks/data/text.txt;
* open-ended: short stories and explanations on given topics, where the
  answer has little to repeat.

For each workload and batch size B: B prompts, up to G new tokens each,
greedy (stopping at the end-of-sequence token), timed with G new tokens
and with 1, so that decode tokens/s is the tokens after the first over the
difference (prefills excluded).  The engines take turns, one repetition
each, so that a ratio compares rates measured in the same minutes.
Reported, per method: decode tokens/s against plain decoding's, their
ratio, whether both gave the same tokens (greedy: they must), and its
drafts, tokens proposed and accepted in the timed runs (acceptance rate,
mean accepted length: tokens a verify step emits per sequence).  Any
compilation during the timed runs fails the run.

    python benchmarks/speculative.py [--model DIR] [--backend inductor]
        [--k 4] [--batch-sizes 1,4,8] [--new-tokens 128]
        [--draft DIR] [--speculator DIR] [--methods ngram,draft,mlp]
        [--repetitions 3] [--dtype float32] [--json PATH]
"""
from __future__ import annotations

import statistics
import sys
import time

from spyre_support.bench import (TEXT, Child, add_json_option,
                                 benchmark_parser, compiled_in_timed_runs,
                                 cores, machine_info, parse_ints, table,
                                 write_json)
from spyre_support.engines import compile_count
from spyre_support.envs import cb_env, cb_max_model_len

GROUNDED = [
    "Repeat the following passage exactly, word for word.\n\n{passage}",
    "Return the following passage unchanged, with each sentence on its "
    "own line.\n\n{passage}",
    "Copy this text into your answer without changing it:\n\n{passage}",
    "Here is a record:\n{record}\nList each field of the record as "
    "'field: value', one per line.",
]
TOPICS = ["a lighthouse keeper", "a city garden", "an old clock",
          "a river in winter", "a bakery at dawn", "a lost letter",
          "a mountain train", "a library cat"]
OPEN = ["Write a short story about {topic}.",
        "Explain to a child what {topic} is like."]
RECORD = ("Name: {name}\nCity: {city}\nDate: 14 March 1998\nOccupation: "
          "lighthouse keeper\nHeight of the tower: 43 metres\nRange of the "
          "light: 22 nautical miles")
NAMES = ["Ada Lindqvist", "Tomas Ferreira", "Mei Nakamura", "Olu Adeyemi"]
CITIES = ["Bergen", "Porto", "Hakodate", "Lagos"]


def passages(count: int, words: int = 90) -> list[str]:
    """``count`` passages of about ``words`` words from the benchmark
    text, one per paragraph run."""
    text = TEXT.read_text().split()
    step = max(len(text) // count, words)
    return [" ".join(text[i * step:i * step + words]) for i in range(count)]


def chat_prompts(model: str, kind: str, batch: int) -> list[list[int]]:
    """``batch`` prompts of a workload, as token ids through the model's
    chat template."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    texts = []
    for i in range(batch):
        if kind == "grounded":
            template = GROUNDED[i % len(GROUNDED)]
            texts.append(template.format(
                passage=passages(batch)[i],
                record=RECORD.format(name=NAMES[i % len(NAMES)],
                                     city=CITIES[i % len(CITIES)])))
        else:
            texts.append(OPEN[i % len(OPEN)].format(
                topic=TOPICS[i % len(TOPICS)]))
    return [tok.apply_chat_template([{"role": "user", "content": t}],
                                    add_generation_prompt=True)
            for t in texts]


class Runner:
    """Lives in the child: one engine, timing generate calls."""

    def __init__(self, model: str, engine_args: dict) -> None:
        from vllm import LLM
        start = time.perf_counter()
        self.llm = LLM(model=model, **engine_args)
        self.start_s = time.perf_counter() - start

    def info(self) -> dict:
        return dict(start_s=self.start_s)

    def counts(self) -> tuple[int, int, int]:
        """Drafts, tokens proposed and accepted so far (0s if plain)."""
        c = getattr(self.llm.llm_engine.output_processor, "counters", None)
        return (c.drafts, c.draft_tokens, c.accepted) if c else (0, 0, 0)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> dict:
        from vllm import SamplingParams, TokensPrompt
        before, counts = compile_count(), self.counts()
        start = time.perf_counter()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(max_tokens=new_tokens, temperature=0),
            use_tqdm=False)
        seconds = time.perf_counter() - start
        after = self.counts()
        return dict(seconds=seconds,
                    ids=[list(o.outputs[0].token_ids) for o in outs],
                    counts=[a - b for a, b in zip(after, counts)],
                    compiles=compile_count() - before)


def start_engines(model: str, engines, env: dict, children: dict,
                  label: str = "") -> dict:
    """A ``Runner`` child per (name, engine arguments) into ``children``
    (started one after another); each one's start-up info."""
    info = {}
    for name, engine_args in engines:
        print(f"[{label}{name}] starting ...", flush=True)
        children[name] = Child(name, Runner, model, engine_args, env=env)
        info[name] = children[name].result()
    return info


def decode_once(child: Child, prompts, new_tokens: int) -> dict:
    """Decode tokens/s of ``prompts`` (up to G tokens against 1), the ids,
    the speculation counts and the compilations of the G-token run."""
    full = child.call("generate", prompts, new_tokens)
    first = child.call("generate", prompts, 1)
    tokens = sum(len(ids) - 1 for ids in full["ids"])
    return dict(rate=tokens / (full["seconds"] - first["seconds"]),
                ids=full["ids"], counts=full["counts"],
                compiles=full["compiles"] + first["compiles"])


def main() -> int:
    ap = benchmark_parser(__doc__, backend=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft", help="a draft model's folder")
    ap.add_argument("--speculator", help="an MLP speculator's folder")
    ap.add_argument("--methods", default="ngram,draft,mlp",
                    help="of ngram, draft (with --draft), mlp (with "
                    "--speculator)")
    add_json_option(ap, "speculative.json")
    args = ap.parse_args()
    sizes = parse_ints(args.batch_sizes)
    plans = [(kind, b, chat_prompts(args.model, kind, b))
             for kind in ("grounded", "open") for b in sizes]
    longest = max(len(p) for _, _, prompts in plans for p in prompts)
    base_args = dict(dtype=args.dtype, max_num_seqs=max(sizes),
                     max_model_len=cb_max_model_len(longest,
                                                    args.new_tokens))
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 2},
             "draft": args.draft and {"model": args.draft,
                                      "num_speculative_tokens": args.k},
             "mlp": args.speculator and {"model": args.speculator,
                                         "num_speculative_tokens": args.k}}
    methods = [m for m in args.methods.split(",") if specs.get(m)]
    engines = [("plain", base_args)] + [
        (m, dict(base_args, speculative_config=specs[m])) for m in methods]
    result = dict(args=vars(args), machine=machine_info(), runs=[])
    env = cb_env(args.backend)
    children: dict = {}
    compiles = 0
    rates: dict = {}
    try:
        result.update(start_engines(args.model, engines, env, children))
        for _, _, prompts in plans:  # warm: every batch size once
            for child in children.values():
                child.call("generate", prompts, 2)
        for _ in range(args.repetitions):
            for kind, b, prompts in plans:
                for name, child in children.items():
                    run = decode_once(child, prompts, args.new_tokens)
                    compiles += run["compiles"]
                    rates.setdefault((kind, b, name), []).append(run)
    finally:
        for child in children.values():
            child.close()

    rows = []
    for kind, b, _ in plans:
        plain = rates[(kind, b, "plain")]
        p = statistics.median(r["rate"] for r in plain)
        tokens = sum(len(i) for i in plain[0]["ids"])
        for method in methods:
            spec = rates[(kind, b, method)]
            s = statistics.median(r["rate"] for r in spec)
            same = all(x["ids"] == y["ids"] for x, y in zip(plain, spec))
            drafts, proposed, accepted = (sum(r["counts"][i] for r in spec)
                                          for i in range(3))
            rate = accepted / proposed if proposed else 0.0
            length = 1 + accepted / drafts if drafts else 1.0
            rows.append([kind, b, method, tokens, f"{p:.1f}", f"{s:.1f}",
                         f"{s / p:.2f}x", "yes" if same else "NO", drafts,
                         f"{100 * rate:.0f}%", f"{length:.2f}"])
            result["runs"].append(dict(
                workload=kind, batch=b, method=method, output_tokens=tokens,
                plain_tok_s=p, tok_s=s, speedup=s / p, same_tokens=same,
                drafts=drafts, proposed=proposed, accepted=accepted,
                acceptance_rate=rate, mean_accepted_length=length))
    result["compiles"] = compiles
    write_json(args.json, result)
    print(f"\nmodel {args.model} ({args.dtype}), backend {args.backend}, "
          f"continuous batching, k={args.k} (n-gram: suffixes of 2-4 "
          f"tokens; draft: {args.draft}; mlp: {args.speculator}), up to "
          f"G={args.new_tokens} new tokens, greedy, {cores()} cores, "
          f"median of {args.repetitions}")
    print(table(["workload", "B", "method", "output tokens", "plain tok/s",
                 "tok/s", "speed-up", "same tokens", "drafts", "accepted",
                 "mean accepted length"], rows))
    failed = compiled_in_timed_runs(compiles) or not all(
        r["same_tokens"] for r in result["runs"])
    if not all(r["same_tokens"] for r in result["runs"]):
        print("FAILED: speculative decoding changed greedy tokens")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
