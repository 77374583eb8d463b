"""Speculative decoding beside llama.cpp's, at batch 1, on the prompts of
benchmarks/speculative.py.

llama.cpp speculates one sequence at a time, in its example tools:
``llama-lookup`` (n-gram lookup: n-grams of 1 to 4 tokens of the prompt
and the answer so far, up to K drafted tokens a step) and, with
``--draft GGUF``, ``llama-speculative`` (a draft model); its plain
decoding is ``llama-lookup`` with no draft (``--spec-draft-n-max 0``).  Each
tool decodes the chat-templated prompt text (it tokenizes it itself),
greedy, up to G new tokens, stopping at the end-of-sequence token, on
``cores()`` threads, and reports its decode tokens/s (prompt excluded)
and its drafted and accepted tokens.

Spyre: the engines of benchmarks/speculative.py (plain; n-gram lookup of
2-4 tokens with the same K; with ``--spyre-draft DIR`` the draft model),
each in its own process, decode tokens/s as that benchmark measures it
(G tokens against 1).  For each workload, the first ``--prompts``
prompts, one at a time: tokens/s summed over them (total tokens over
total seconds), each engine's speed-up over its own plain decoding, and
Spyre's speculative tokens/s over llama.cpp's.  llama.cpp's threads spin
at every barrier: compare on an otherwise idle machine.

    python benchmarks/speculative_peer.py [--model DIR] [--backend inductor]
        [--k 4] [--new-tokens 128] [--prompts 4]
        [--draft GGUF --spyre-draft DIR] [--json PATH]

Needs ``bash benchmarks/peers/setup_llamacpp.sh`` (the tools and the
model's F32 GGUF); a draft's GGUF: ``MODEL=DIR GGUF_TYPES=f32 bash
benchmarks/peers/setup_llamacpp.sh``.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from _peers import PEERS, SETUP, llamacpp_gguf
from speculative import chat_prompts, decode_once, start_engines
from spyre_support.bench import (add_json_option, benchmark_parser,
                                 compiled_in_timed_runs, cores, machine_info,
                                 table, write_json)
from spyre_support.envs import cb_env, cb_max_model_len

TOOLS = PEERS / "llama.cpp" / "build" / "bin"
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
COUNT = re.compile(r"\b(n_drafted|n_accept)\s*=\s*(\d+)")


def llamacpp(tool: str, gguf: Path, text: str, new_tokens: int,
             extra: list[str]) -> dict:
    """One run of a llama.cpp speculative tool: decoded tokens, seconds,
    drafted and accepted tokens."""
    cmd = [str(TOOLS / tool), "-m", str(gguf), "-p", text, "-n",
           str(new_tokens), "-t", str(cores()), "-c", "4096", "--temp", "0",
           "--seed", "0", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    decoded = DECODED.search(out)
    if proc.returncode != 0 or decoded is None:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed:\n{out[-2000:]}")
    counts = dict((k, int(v)) for k, v in COUNT.findall(out))
    return dict(tokens=int(decoded.group(1)),
                seconds=float(decoded.group(2)),
                drafted=counts.get("n_drafted", 0),
                accepted=counts.get("n_accept", 0))


def texts(model: str, kind: str, count: int) -> list[str]:
    """The workload's first ``count`` prompts as chat-templated text."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    return [tok.decode(ids) for ids in chat_prompts(model, kind, count)]


def main() -> int:
    ap = benchmark_parser(__doc__, backend=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft", help="a draft model's GGUF, for llama.cpp")
    ap.add_argument("--spyre-draft", help="the same draft's folder")
    add_json_option(ap, "speculative_peer.json")
    args = ap.parse_args()
    gguf = llamacpp_gguf(args.model, "f32")
    if not (TOOLS / "llama-lookup").exists() or not gguf.exists():
        print(f"llama.cpp or {gguf.name} is missing; run: {SETUP}")
        return 2
    plans = [(kind, chat_prompts(args.model, kind, args.prompts),
              texts(args.model, kind, args.prompts))
             for kind in ("grounded", "open")]
    longest = max(len(p) for _, ids, _ in plans for p in ids)
    base = dict(dtype=args.dtype, max_num_seqs=1,
                max_model_len=cb_max_model_len(longest, args.new_tokens))
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}}
    peers = {"ngram": ("llama-lookup", ["--spec-draft-n-max", str(args.k)])}
    if args.draft and args.spyre_draft:
        specs["draft"] = {"model": args.spyre_draft,
                          "num_speculative_tokens": args.k}
        peers["draft"] = ("llama-speculative",
                          ["-md", args.draft, "--spec-draft-n-max",
                           str(args.k), "--spec-draft-n-min", "0", "-td",
                           str(cores())])
    engines = [("plain", base)] + [
        (m, dict(base, speculative_config=s)) for m, s in specs.items()]
    totals: dict = {}
    compiles = 0
    children: dict = {}
    try:
        start_engines(args.model, engines, cb_env(args.backend), children,
                      "spyre ")
        for kind, ids, prompts in plans:
            for name, child in children.items():
                child.call("generate", ids[:1], 2)  # warm
            for prompt_ids, text in zip(ids, prompts):
                for name, child in children.items():
                    run = decode_once(child, [prompt_ids], args.new_tokens)
                    compiles += run["compiles"]
                    add(totals, ("spyre", kind, name),
                        len(run["ids"][0]) - 1,
                        (len(run["ids"][0]) - 1) / run["rate"],
                        run["counts"][1], run["counts"][2])
                for name, (tool, extra) in [
                        ("plain", ("llama-lookup",
                                   ["--spec-draft-n-max", "0"])),
                        *peers.items()]:
                    run = llamacpp(tool, gguf, text, args.new_tokens, extra)
                    add(totals, ("llama.cpp", kind, name), run["tokens"],
                        run["seconds"], run["drafted"], run["accepted"])
    finally:
        for child in children.values():
            child.close()

    rows, result = [], dict(args=vars(args), machine=machine_info(),
                            runs=[], compiles=compiles)
    for kind, _, _ in plans:
        for method in specs:
            cells = [kind, method]
            entry = dict(workload=kind, method=method)
            for engine in ("spyre", "llama.cpp"):
                plain = rate(totals[(engine, kind, "plain")])
                spec = totals[(engine, kind, method)]
                cells += [f"{plain:.1f}", f"{rate(spec):.1f}",
                          f"{rate(spec) / plain:.2f}x",
                          f"{100 * spec[3] / max(spec[2], 1):.0f}%"]
                entry[engine] = dict(plain_tok_s=plain, tok_s=rate(spec),
                                     speedup=rate(spec) / plain,
                                     drafted=spec[2], accepted=spec[3])
            ratio = entry["spyre"]["tok_s"] / entry["llama.cpp"]["tok_s"]
            cells.append(f"{ratio:.2f}x")
            entry["spyre_over_llamacpp"] = ratio
            rows.append(cells)
            result["runs"].append(entry)
    write_json(args.json, result)
    print(f"\nmodel {args.model} ({args.dtype}; llama.cpp {gguf.name}), "
          f"backend {args.backend}, batch 1, k={args.k}, up to "
          f"G={args.new_tokens} new tokens, greedy, {args.prompts} prompts "
          f"a workload, {cores()} cores")
    print(table(["workload", "method", "spyre plain tok/s", "spyre tok/s",
                 "spyre speed-up", "spyre accepted", "llama.cpp plain tok/s",
                 "llama.cpp tok/s", "llama.cpp speed-up",
                 "llama.cpp accepted", "spyre / llama.cpp"], rows))
    return 1 if compiled_in_timed_runs(compiles) else 0


def add(totals: dict, key, tokens: int, seconds: float, drafted: int,
        accepted: int) -> None:
    have = totals.setdefault(key, [0, 0.0, 0, 0])
    for i, v in enumerate((tokens, seconds, drafted, accepted)):
        have[i] += v


def rate(total) -> float:
    return total[0] / total[1] if total[1] else 0.0


if __name__ == "__main__":
    sys.exit(main())
