"""LoRA adapters loaded while ``vllm serve`` streams: how long the running
streams wait between two tokens when a request on another adapter arrives,
and when a new adapter is loaded and first asked for.

One server (continuous batching on vLLM's model code, ``--enable-lora
--max-loras 4 --max-lora-rank R``, run-time loading on): two adapters
registered at start-up (``running``, ``loaded``) and warmed, then
``--streams`` completions stream on ``running`` (prompts of P tokens, G
new tokens each, greedy).  A third of the way into the first stream, a
one-token request on ``loaded`` (in memory already: its prefill is the
only work); two thirds in, ``POST /v1/load_lora_adapter`` of a new
adapter, and 8 tokens later a one-token request on it (vLLM reads the
adapter's tokenizer when its first request arrives).  Every adapter is
random, of rank R over every projection, written in PEFT's layout
(``spyre_support.tiny_lora.write_random_adapter``).

Reported: each event's time as the client saw it, and the running
streams' gaps between two tokens: their median away from the events,
and the longest gap that overlaps each event.

    python benchmarks/lora_server.py [--model DIR] [--backend eager]
        [--rank 16] [--streams 7] [--prompt-len 64] [--new-tokens 96]
        [--json PATH]
"""
from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from spyre_support.bench import (add_json_option, benchmark_parser,
                                 build_prompts, cores, machine_info, table,
                                 text_ids, write_json)
from spyre_support.envs import cb_env, cb_max_model_len
from spyre_support.load import completion_body, timed_stream


async def timed_post(client: httpx.AsyncClient, url: str, path: str,
                     body: dict) -> tuple[float, float]:
    start = time.monotonic()  # the clock of timed_stream's arrivals
    resp = await client.post(url + path, json=body)
    assert resp.status_code == 200, resp.text
    return start, time.monotonic()


async def drive(url: str, prompts: list[list[int]], new_tokens: int,
                new_adapter: str) -> dict:
    """The streams on ``running`` and the three events among them."""
    async with httpx.AsyncClient(timeout=600) as client:
        for name in ("running", "loaded"):  # both read and in a slot
            await timed_post(client, url, "/v1/completions",
                             dict(model=name, prompt=prompts[0],
                                  max_tokens=2))
        runs: list[list[float]] = [[] for _ in prompts]
        streams = [asyncio.create_task(timed_stream(
            client, url + "/v1/completions",
            completion_body("running", p, new_tokens), times))
            for p, times in zip(prompts, runs)]
        events = {}

        async def at(tokens: int) -> None:
            while len(runs[0]) < tokens:
                await asyncio.sleep(0.002)

        await at(new_tokens // 3)
        events["request on a loaded adapter"] = await timed_post(
            client, url, "/v1/completions",
            dict(model="loaded", prompt=prompts[0][:8], max_tokens=1))
        await at(2 * new_tokens // 3)
        events["load_lora_adapter of a new one"] = await timed_post(
            client, url, "/v1/load_lora_adapter",
            dict(lora_name="new", lora_path=new_adapter))
        await at(len(runs[0]) + 8)  # the two events' gaps kept apart
        events["its first request"] = await timed_post(
            client, url, "/v1/completions",
            dict(model="new", prompt=prompts[0][:8], max_tokens=1))
        await asyncio.gather(*streams)
    assert all(len(times) == new_tokens for times in runs)
    gaps = [(a, b) for times in runs for a, b in zip(times, times[1:])]
    during = {name: max((b - a for a, b in gaps if b > start and a < end),
                        default=0.0)
              for name, (start, end) in events.items()}
    quiet = [b - a for a, b in gaps
             if not any(b > s and a < e for s, e in events.values())]
    return dict(events_ms={k: 1e3 * (e - s) for k, (s, e) in events.items()},
                longest_gap_ms={k: 1e3 * v for k, v in during.items()},
                median_gap_ms=1e3 * statistics.median(quiet))


def main() -> int:
    from spyre_support.server import Server
    from spyre_support.tiny_lora import write_random_adapter
    ap = benchmark_parser(__doc__, backend=True)
    ap.set_defaults(backend="eager")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    add_json_option(ap, "lora_server.json")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lora-server-bench-"))
    try:
        folders = {name: str(write_random_adapter(
            Path(args.model), root / name, seed=i, rank=args.rank))
            for i, name in enumerate(("running", "loaded", "new"), 1)}
        env = dict(cb_env(args.backend),
                   VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        cli = ("--model-impl", "vllm", "--enable-lora", "--max-loras", "4",
               "--max-lora-rank", str(args.rank), "--lora-modules",
               f"running={folders['running']}",
               f"loaded={folders['loaded']}",
               "--max-num-seqs", str(args.streams + 1), "--max-model-len",
               str(cb_max_model_len(args.prompt_len, args.new_tokens)))
        print(f"vllm serve {args.model} {' '.join(cli)} (backend "
              f"{args.backend}; warm-up takes a while)", flush=True)
        prompts = build_prompts(text_ids(args.model), args.streams,
                                args.prompt_len)
        with Server(Path(args.model), env, cli) as server:
            result = asyncio.run(drive(server.url, prompts, args.new_tokens,
                                       folders["new"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result.update(args=vars(args), machine=machine_info())
    write_json(args.json, result)
    print(f"\nmodel {Path(args.model).name}, backend {args.backend}, "
          f"{args.streams} streams on one adapter, P={args.prompt_len} "
          f"G={args.new_tokens}, rank {args.rank}, {cores()} cores; the "
          f"streams' median gap between tokens away from the events: "
          f"{result['median_gap_ms']:.1f} ms")
    print(table(["event", "its time (ms)",
                 "longest gap of the streams across it (ms)"],
                [[name, f"{ms:.1f}", f"{result['longest_gap_ms'][name]:.1f}"]
                 for name, ms in result["events_ms"].items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
