"""Prefill against the machine's peak matrix throughput.

A prompt's prefill multiplies many rows by every weight, so it is bound
by arithmetic, not by reading: its limit is the machine's peak matrix
throughput.  This script measures that peak first (the best of N bfloat16
and float32 products of two square matrices through PyTorch, oneDNN's
kernels, every core), then runs one prompt of ``--prompt-len`` tokens at
batch 1 through each engine (offline.py's engines and workload, one
process each, timed runs alternated) and reports the time to first token
against the product arithmetic the prompt needs: 2 x (the weights of its
linear layers) x tokens, plus the attention's 4 x layers x hidden x
tokens^2 / 2 (causal).

    python benchmarks/prefill.py --model models/bench/granite-3.3-2b-bf16 \\
        [--engines spyre-eager-bf16] [--prompt-len 512] [--repetitions 3]
        [--matrix 4096] [--json PATH]
"""
from __future__ import annotations

import sys
import time

from spyre_support.bench import (Workload, add_json_option, benchmark_parser,
                                 compiled_in_timed_runs, cores, machine_info,
                                 table, write_json)
from _engines import measure, start_engines, stop_engines


def peak_matmul(n: int, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of the fastest of ``repeats`` ``n x n`` products, per dtype."""
    import torch
    torch.set_num_threads(cores())
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - start)
        rates[str(dtype).removeprefix("torch.")] = 2 * n**3 / best
    return rates


def prompt_flops(model: str, tokens: int) -> float:
    """Product arithmetic of one causal prompt of ``tokens`` tokens."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model)
    hidden, layers = c.hidden_size, c.num_hidden_layers
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    head = hidden // heads
    per_layer = (hidden * head * (heads + 2 * kv) + heads * head * hidden +
                 3 * hidden * c.intermediate_size)
    linear = layers * per_layer + hidden * c.vocab_size / tokens  # last row
    attention = 4 * layers * hidden * tokens * tokens / 2
    return 2 * linear * tokens + attention


def main() -> int:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--engines", default="spyre-eager-bf16")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--matrix", type=int, default=4096,
                    help="size of the square products timed for the peak")
    add_json_option(ap, "prefill.json")
    args = ap.parse_args()

    peaks = peak_matmul(args.matrix)  # before any engine exists
    for dtype, rate in peaks.items():
        print(f"peak matrix throughput, {dtype}: {rate / 1e9:.0f} GFLOP/s",
              flush=True)
    engines = args.engines.split(",")
    work = Workload.build(args.model, args.prompt_len, 2, [1])
    children = start_engines(engines, work)
    try:
        timings, _ = measure(children, work, args.repetitions)
    finally:
        stop_engines(children)
    flops = prompt_flops(args.model, args.prompt_len)
    rows, results = [], {}
    for engine in engines:
        s = timings[engine, 1].summary()
        rate = flops / (s["ttft_s"])
        results[engine] = dict(median=s, flop_per_s=rate,
                               of_bf16_peak=rate / peaks["bfloat16"])
        rows.append([engine, f"{s['ttft_s'] * 1e3:.0f}", f"{rate / 1e9:.0f}",
                     f"{rate / peaks['bfloat16'] * 100:.1f}%",
                     f"{rate / peaks['float32'] * 100:.1f}%",
                     s["compiles"]])
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               peak_flop_per_s=peaks, prompt_flops=flops,
                               engines=results))
    print(f"\nmodel {args.model}, one prompt of {args.prompt_len} tokens, "
          f"{flops / 1e12:.2f} TFLOP, median of {args.repetitions}, "
          f"{cores()} cores")
    print(table(["engine", "TTFT ms", "GFLOP/s", "of bf16 peak",
                 "of fp32 peak", "compiles"], rows))
    compiled = sum(r["median"]["compiles"] for r in results.values())
    if compiled_in_timed_runs(compiled):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
