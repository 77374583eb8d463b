"""The report of ``serving_load.py``'s continuous-against-static
comparison: CB/static ratios, the side-by-side table and the plot."""
from __future__ import annotations

from pathlib import Path

from spyre_support.bench import table


def ratios(modes: dict) -> dict[str, dict[str, float]]:
    """Each continuous-batching server (``cb``, or ``cb-N`` per
    ``--max-num-seqs`` N) over static: output tokens/s (>1: CB faster),
    TTFT and ITL p50 (<1: CB faster)."""
    if "static" not in modes:
        return {}
    st = modes["static"]["result"]
    out = {}
    for name, m in modes.items():
        if name.startswith("cb"):
            cb = m["result"]
            out[name] = {"output_tok_s": cb["tok_per_s"] / st["tok_per_s"],
                         "ttft_p50": cb["ttft_p50_ms"] / st["ttft_p50_ms"],
                         "itl_p50": cb["itl_p50_ms"] / st["itl_p50_ms"]}
    return out


def print_comparison(modes: dict, workload: dict) -> None:
    print(f"\nmodel {Path(workload['model']).name}, {workload['requests']} "
          f"requests, concurrency {workload['concurrency']}, "
          f"{workload['text']}; {workload['output_tokens']} output tokens")
    for mode, m in modes.items():
        print(f"{mode}: {m['server']['description']}, backend "
              f"{m['server']['backend']}")
    rows = []
    for mode, m in modes.items():
        r, s = m["result"], m["startup"]
        rows.append([mode, f"{r['req_per_s']:.2f}", f"{r['tok_per_s']:.1f}",
                     f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}",
                     f"{r['itl_p50_ms']:.0f}", f"{r['itl_p99_ms']:.0f}",
                     r["errors"], m["preemptions"], f"{r['wall_s']:.1f}",
                     f"{s.get('warmup_s', float('nan')):.1f}"])
    print(table(["mode", "req/s", "output tok/s", "TTFT p50 ms",
                 "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "errors",
                 "preempted", "wall s", "warm-up s"], rows))
    for name, r in ratios(modes).items():
        print(f"{name}/static: output tok/s {r['output_tok_s']:.2f}x, TTFT "
              f"p50 {r['ttft_p50']:.2f}x, ITL p50 {r['itl_p50']:.2f}x")


def plot(path: str, modes: dict, workload: dict) -> None:
    """TTFT p50 and p99 (left) and output tokens/s (right) per mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(modes)
    res = [modes[m]["result"] for m in names]
    blues = iter(["tab:blue", "tab:cyan", "tab:purple", "tab:green"])
    colors = [next(blues, "tab:blue") if m.startswith("cb") else
              "tab:orange" for m in names]
    x = range(len(names))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    width = 0.38
    for bars in (
            left.bar([i - width / 2 for i in x],
                     [r["ttft_p50_ms"] for r in res], width, color=colors),
            left.bar([i + width / 2 for i in x],
                     [r["ttft_p99_ms"] for r in res], width, color=colors,
                     alpha=0.45, hatch="//")):
        left.bar_label(bars, fmt="%.0f", fontsize=8)
    left.set_ylabel("time to first token, ms")
    left.set_title("TTFT (p50 solid, p99 hatched)")
    right.bar_label(right.bar(list(x), [r["tok_per_s"] for r in res], 0.6,
                              color=colors), fmt="%.1f", fontsize=8)
    right.set_ylabel("output tokens/s")
    right.set_title("throughput")
    for ax in (left, right):
        ax.set_xticks(list(x), names)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{Path(workload['model']).name}, {workload['requests']} "
                 f"requests, concurrency {workload['concurrency']}\n"
                 f"{workload['text']}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
