"""Offline generation throughput: our Spyre engine against Hugging Face
transformers, IBM FMS and llama.cpp, on one fixed workload.

For each batch size B: B prompts of exactly P tokens cut from
benchmarks/data/text.txt (row i starts at token 13*i), G new tokens each,
greedy, EOS ignored.  Every engine runs in its own process and is loaded,
compiled and warmed up for every batch size before anything is timed; then
the repetitions alternate between engines (rep 1 of every engine, then rep
2, ...), so slow drifts of the machine hit every engine alike.  Reported
numbers are medians: decode tokens/s B*(G-1)/(total-TTFT), time to first
token, total time, overall tokens/s B*G/total, and ours/peer ratios.

The generated ids of all engines are compared per batch size; a mismatch
or any compilation during a timed run makes the script exit non-zero
(``--allow-mismatch`` forgives mismatches, never compilations).

Engines: spyre-inductor, spyre-eager (ours, by compile backend),
spyre-inductor-graph-cache (ours on inductor with the graph cache on, so
graphs precompiled and weights not frozen), spyre-cb-inductor, spyre-cb-eager (ours under continuous batching:
VLLM_SPYRE_USE_CB=1, max_num_seqs the largest B, max_model_len P+G rounded
up to 64; the B prefills run one by one, then every decode step runs the
whole batch), hf (transformers generate, sdpa), fms (FMS generate on the
FMS model compiled with inductor), fms-eager (the same with the eager
backend: a cheap check of the FMS path), llamacpp-f32, llamacpp-bf16,
llamacpp-q8_0, llamacpp-q4_0, llamacpp-q4_1 (llama.cpp through its C API on
GGUF files of the model, B sequences in one context, one decode call per
step; set up once with ``bash benchmarks/peers/setup_llamacpp.sh``), and
spyre-inductor-bf16, spyre-eager-bf16 and their spyre-cb-* twins (ours
served with --dtype bfloat16), and spyre-<backend>-<format>,
spyre-cb-<backend>-<format> with backend inductor or eager (ours, static and
continuous batching, on the model quantized by scripts/quantize.py to
<format>: gptq-int8, fp8, fp8-dynamic, w8a16, gptq-int4 or w4a16, the
output head included, served with --dtype bfloat16; written on first use
under .quantized/).  TTFT is the time until every row has its first
token.  Ratios are shown against the peers at each of our engines'
precision: float32 against llamacpp-f32, bf16 against llamacpp-bf16, our
8-bit formats against llamacpp-q8_0 and our 4-bit ones against
llamacpp-q4_0 and llamacpp-q4_1; a quantized engine run next to ours in
bf16 also gets "decode q/bf16", its decode tokens/s over bf16's.  Before
the table, each engine's resident memory after warm-up.  llama.cpp's
kernels round differently from torch's: its ids agree with ours for some
leading tokens (the ids column says how many), then may part; pass
``--allow-mismatch`` to accept that.  A CB engine run next to its static
counterpart gets the column cbstep/static: static decode tok/s over CB
decode tok/s, the cost of a CB decode step relative to a static one (> 1:
CB slower).

    python benchmarks/offline.py [--model DIR] [--batch-sizes 1,4,8,16]
        [--prompt-len 64] [--new-tokens 64] [--repetitions 3]
        [--engines spyre-inductor,spyre-eager,hf,fms]
        (add spyre-cb-inductor,spyre-cb-eager for continuous batching,
        llamacpp-f32,llamacpp-bf16,llamacpp-q8_0,llamacpp-q4_0,llamacpp-q4_1
        for llama.cpp, spyre-<backend>-<format> and
        spyre-cb-<backend>-<format> for ours on a quantized checkpoint)
        [--json PATH] [--plot PATH] [--allow-mismatch]
        [--model-impl vllm]

``--model-impl vllm`` adds, beside each of our engines, its twin on vLLM's
own model code (``<engine>-vllm``, ``LLM(model_impl="vllm")``), and the
column "decode vllm/fms": its decode tokens/s over the FMS engine's (< 1:
vLLM's model code slower).  The comparison in docs/model-implementations.md:

    python benchmarks/offline.py --engines spyre-inductor --model-impl vllm \
        --batch-sizes 1,8

The decode tokens/s plot is written only with ``--plot``; the one in
docs/performance.md:

    python benchmarks/offline.py --plot docs/images/offline-throughput.png
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from spyre_support.bench import (STRIDE, TEXT, Workload, add_json_option,
                                 add_shape_options, benchmark_parser,
                                 compiled_in_timed_runs, cores,
                                 leading_matches, machine_info, parse_ints,
                                 table, write_json)
from _engines import (ENGINES, is_cb, is_ours, measure, start_engines,
                      stop_engines)


def compare(engines: list[str], work: Workload, ids: dict) -> list[dict]:
    """Every pair of engines, every batch size: equal ids?  Also each
    engine against itself across repetitions (determinism)."""
    found = []
    for batch in work.batch_sizes:
        for engine in engines:
            reps = ids[engine, batch]
            if any(r != reps[0] for r in reps[1:]):
                found.append(dict(batch=batch, a=engine, b=engine,
                                  equal=False, what="differs between "
                                  "repetitions"))
        for a, b in itertools.combinations(engines, 2):
            rows_a, rows_b = ids[a, batch][-1], ids[b, batch][-1]
            leading = [leading_matches(x, y) for x, y in zip(rows_a, rows_b)]
            equal = rows_a == rows_b
            first = None
            if not equal:
                row = min(range(len(leading)), key=lambda i: leading[i])
                first = dict(row=row, token=leading[row])
            found.append(dict(batch=batch, a=a, b=b, equal=equal,
                              leading_per_row=leading, first_diff=first))
    return found


def print_agreement(engines: list[str], work: Workload, ids: dict,
                    mismatched: list[dict]) -> None:
    """Per batch size, the engines grouped by identical ids ('=' joins a
    group, ';' separates groups), then every mismatch in detail."""
    for batch in work.batch_sizes:
        groups: list[list[str]] = []
        for engine in engines:
            same = next((g for g in groups if ids[g[0], batch][-1] ==
                         ids[engine, batch][-1]), None)
            if same is None:
                groups.append([engine])
            else:
                same.append(engine)
        print(f"ids B={batch}: " + "; ".join(" = ".join(g) for g in groups))
    for c in mismatched:
        if c["a"] == c["b"]:
            print(f"MISMATCH B={c['batch']} {c['a']}: ids {c['what']}")
        else:
            print(f"MISMATCH B={c['batch']} {c['a']} vs {c['b']}: first "
                  f"difference at row {c['first_diff']['row']}, token "
                  f"{c['first_diff']['token']}; leading matching tokens per "
                  f"row {c['leading_per_row']}")


CB_STEP = "cbstep/static"
VLLM_FMS = "decode vllm/fms"
QUANT_BF16 = "decode q/bf16"


def same_precision(a: str, b: str) -> bool:
    return ENGINES[a].precision == ENGINES[b].precision


def ratio_peers(engines: list[str]) -> list[str]:
    """The engines ours are divided by in the ratio columns: each peer at
    the precision of at least one of ours."""
    ours = [e for e in engines if is_ours(e)]
    return [e for e in engines if not is_ours(e)
            and any(same_precision(e, o) for o in ours)]


def ratios(engines: list[str], summaries: dict, batch: int,
           engine: str) -> dict[str, float]:
    """Ours / each peer: decode tokens/s (>1: ours faster) and TTFT
    (<1: ours faster); for a continuous-batching engine whose static
    counterpart ran too, the decode step time CB / static (>1: CB
    slower)."""
    if not is_ours(engine):
        return {}
    mine = summaries[engine, batch]
    out = {}
    for peer in ratio_peers(engines):
        if not same_precision(peer, engine):
            continue
        theirs = summaries[peer, batch]
        out[f"decode/{peer}"] = mine["decode_tok_s"] / theirs["decode_tok_s"]
        out[f"ttft/{peer}"] = mine["ttft_s"] / theirs["ttft_s"]
    static = ENGINES[engine].static_peer
    if static in engines:
        out[CB_STEP] = (summaries[static, batch]["decode_tok_s"] /
                        mine["decode_tok_s"])
    fms = ENGINES[engine].fms_peer
    if fms in engines:
        out[VLLM_FMS] = (mine["decode_tok_s"] /
                         summaries[fms, batch]["decode_tok_s"])
    unquantized = ENGINES[engine].unquantized_peer
    if unquantized in engines:
        out[QUANT_BF16] = (mine["decode_tok_s"] /
                           summaries[unquantized, batch]["decode_tok_s"])
    return out


def plot(path: str, engines: list[str], work: Workload, summaries: dict):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for engine in engines:
        ax.plot(work.batch_sizes,
                [summaries[engine, b]["decode_tok_s"]
                 for b in work.batch_sizes], marker="o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xticks(work.batch_sizes, [str(b) for b in work.batch_sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{Path(work.model).name}: decode throughput "
                 f"(P={work.prompt_len}, G={work.new_tokens})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    ap = benchmark_parser(__doc__)
    ap.add_argument("--batch-sizes", default="1,4,8,16")
    add_shape_options(ap)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--engines", default="spyre-inductor,spyre-eager,hf,fms")
    add_json_option(ap, "offline.json")
    ap.add_argument("--plot", help="write the decode tokens/s plot here "
                    "(default: no plot)")
    ap.add_argument("--allow-mismatch", action="store_true",
                    help="exit 0 even if engines generate different ids")
    ap.add_argument("--model-impl", choices=("auto", "vllm"), default="auto",
                    help="vllm: run each of our engines also on vLLM's own "
                    "model code (engine name + '-vllm'), beside FMS's")
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    engines = args.engines.split(",")
    if args.model_impl == "vllm":
        engines += [f"{e}-vllm" for e in engines
                    if f"{e}-vllm" in ENGINES and f"{e}-vllm" not in engines]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        ap.error(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    if args.new_tokens < 2 or args.repetitions < 1:
        ap.error("--new-tokens must be >= 2 and --repetitions >= 1")

    work = Workload.build(args.model, args.prompt_len, args.new_tokens,
                          parse_ints(args.batch_sizes))
    children = start_engines(engines, work)
    try:
        timings, ids = measure(children, work, args.repetitions)
    finally:
        stop_engines(children)

    summaries = {k: t.summary() for k, t in timings.items()}
    found = compare(engines, work, ids)
    compiled = sum(s["compiles"] for s in summaries.values())
    mismatched = [c for c in found if not c["equal"]]
    print_agreement(engines, work, ids, mismatched)

    write_json(args.json, dict(
        args=vars(args), machine=machine_info(),
        workload=dict(model=args.model, prompt_len=args.prompt_len,
                      new_tokens=args.new_tokens, text=str(TEXT),
                      stride=STRIDE, batch_sizes=work.batch_sizes),
        engines={e: dict(info=children[e][1], batches={
            b: dict(runs=timings[e, b].runs, median=summaries[e, b],
                    ratios=ratios(engines, summaries, b, e),
                    ids=ids[e, b][-1])
            for b in work.batch_sizes}) for e in engines},
        comparisons=found, compilations=compiled,
        ids_match=not mismatched))
    if args.plot:
        plot(args.plot, engines, work, summaries)
    print_memory(engines, children)
    print_table(engines, work, summaries, found, args.repetitions)
    if compiled_in_timed_runs(compiled):
        return 1
    if mismatched and not args.allow_mismatch:
        print(f"FAILED: {len(mismatched)} id mismatch(es); "
              "--allow-mismatch to accept")
        return 1
    return 0


def print_memory(engines: list[str], children: dict) -> None:
    """Each engine's resident memory after load and warm-up, and the bytes
    its weights are held in where the engine reports them."""
    rows = []
    for engine in engines:
        info = children[engine][1]
        weights = info.get("weight_bytes")
        rows.append([engine, f"{info['rss_bytes'] / 2**20:.0f}",
                     f"{weights / 2**20:.0f}" if weights else "-"])
    print("\nresident memory of each engine's process after warm-up "
          "(Python, torch, vLLM, compiled graphs, caches) and the bytes its "
          "model holds (our engines: parameters and buffers)")
    print(table(["process", "RSS MiB", "weights MiB"], rows))


def ids_cell(found: list[dict], ref: str, engine: str, batch: int,
             new_tokens: int) -> str:
    """The table's 'ids' cell: the fewest leading tokens any row shares
    with the reference engine (G/G: identical), DIFF on a mismatch,
    UNSTABLE if the engine's own repetitions differ."""
    text = "ref"
    for c in found:
        if c["batch"] == batch and c["a"] == ref and c["b"] == engine \
                and ref != engine:
            text = f"{min(c['leading_per_row'])}/{new_tokens}" + (
                "" if c["equal"] else " DIFF")
    if any(c["batch"] == batch and c["a"] == c["b"] == engine
           for c in found):
        text += " UNSTABLE"
    return text


def print_table(engines, work, summaries, found, repetitions) -> None:
    """The result table, printed last."""
    ref = engines[0]
    peers = ratio_peers(engines)
    ratio_cols = [f"{m}/{p}" for p in peers for m in ("decode", "ttft")] \
        if any(is_ours(e) for e in engines) else []
    if any(ENGINES[e].static_peer in engines for e in engines):
        ratio_cols.append(CB_STEP)
    if any(ENGINES[e].fms_peer in engines for e in engines):
        ratio_cols.append(VLLM_FMS)
    if any(ENGINES[e].unquantized_peer in engines for e in engines):
        ratio_cols.append(QUANT_BF16)
    cb = [e for e in engines if is_cb(e)]
    rows = []
    for engine, batch in itertools.product(engines, work.batch_sizes):
        s = summaries[engine, batch]
        r = ratios(engines, summaries, batch, engine)
        rows.append([engine, batch, f"{s['decode_tok_s']:.1f}",
                     f"{s['ttft_s'] * 1e3:.1f}", f"{s['total_s']:.3f}",
                     f"{s['tok_s']:.1f}", s["compiles"]] +
                    ([s["preemptions"] if engine in cb else "-"]
                     if cb else []) +
                    [ids_cell(found, ref, engine, batch, work.new_tokens)] +
                    [f"{r[c]:.2f}x" if c in r else "-" for c in ratio_cols])
    print(f"\nmodel {Path(work.model).name}, P={work.prompt_len}, "
          f"G={work.new_tokens}, median of {repetitions}, {cores()} cores. "
          "Ratios are ours/peer: decode > 1 and TTFT < 1 mean ours is "
          f"faster; {CB_STEP}: CB decode step time over static's. TTFT: "
          "until every row has a token. ids: leading tokens equal to "
          f"{ref}'s (worst row).")
    print(table(["engine", "B", "decode tok/s", "TTFT ms", "total s",
                 "tok/s", "compiles"] + (["preempt"] if cb else []) +
                ["ids"] + ratio_cols, rows))
    preempted = [f"{e} B={b}" for e in cb for b in work.batch_sizes
                 if summaries[e, b]["preemptions"]]
    if preempted:
        print("WARNING: rows were preempted (and recomputed) in the timed "
              f"runs of {', '.join(preempted)}: not every decode step ran "
              f"the whole batch, so {CB_STEP} there is not the step cost.")


if __name__ == "__main__":
    sys.exit(main())
