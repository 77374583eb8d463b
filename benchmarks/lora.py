"""LoRA adapters: decode speed with adapters against the base model alone,
and the time to load an adapter while serving.

Two engines, each in its own process, both alive, on vLLM's model code
with continuous batching (``--max-num-seqs`` the largest batch): the base model
without ``--enable-lora``, and the same with ``--enable-lora --max-loras 4
--max-lora-rank R``.  Four random rank-R adapters over every projection of
the model are written in PEFT's layout from the checkpoint's headers
(``spyre_support.tiny_lora.write_random_adapter``) into a temporary
folder first.

For each batch size B: B prompts of P tokens cut from
benchmarks/data/text.txt, G new tokens each, greedy, EOS ignored, timed
twice per repetition: with G new tokens and with 1, so that decode tokens/s
is B*(G-1) over the difference (prefills excluded).  The engines take
turns, one repetition each, so that a ratio compares rates measured in the
same minutes.  The base engine runs
every B without adapters; the LoRA engine runs every B with one adapter
on every row, and the largest B also with the four adapters spread over
its rows.  Reported: decode tokens/s, and the LoRA step's time over the
base step's (the target: at most 1.3x at batch 8 with rank-16 adapters).
On ``inductor`` a third engine, ``base-inputs``, is the base model with
its weights kept as graph inputs (``VLLM_SPYRE_INDUCTOR_FREEZING=0``), as
the LoRA engine keeps them, and the LoRA step is shown over its step too.
Then, with B-1 requests decoding on one adapter (B the largest), a
request arrives on a second, loaded adapter and later one on a fifth,
new adapter, which its arrival loads (read and checked; the next step
copies it into a slot): the load's time, and the running requests'
median gap between tokens against their gaps across each arrival (the
engine loop of ``vllm serve`` takes requests in between steps the same
way).  Resident memory of both engines after
warm-up and at the end (the LoRA engine then holding its five adapters
and its slots), and the adapters' bytes as the up-front memory check
counts them against the growth measured at the end (on ``inductor``
against ``base-inputs``, whose graphs are set up as the LoRA engine's).
Any compilation during the timed runs fails the run.

    python benchmarks/lora.py [--model DIR] [--backend inductor]
        [--rank 16] [--batch-sizes 1,8] [--prompt-len 64]
        [--new-tokens 64] [--repetitions 3] [--dtype float32] [--json PATH]
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from spyre_support.bench import (Child, add_json_option, add_shape_options,
                                 benchmark_parser, build_prompts,
                                 compiled_in_timed_runs, cores, machine_info,
                                 parse_ints, table, text_ids, write_json)
from spyre_support.engines import compile_count
from spyre_support.envs import cb_env, cb_max_model_len

#: Adapters of the LoRA engine: its slots (``--max-loras``).
SLOTS = 4


class Runner:
    """Lives in the child: one engine, timing generate calls."""

    def __init__(self, model: str, engine_args: dict) -> None:
        import psutil
        from vllm import LLM
        start = time.perf_counter()
        self.llm = LLM(model=model, **engine_args)
        self.start_s = time.perf_counter() - start
        self.rss = psutil.Process().memory_info().rss
        #: The memory check's weights (the adapters' slots included).
        self.weights = self.llm.collective_rpc("get_memory_estimate")[
            0].weights

    def info(self) -> dict:
        return dict(start_s=self.start_s, rss_gib=self.rss / 2**30,
                    estimated_weights_gib=self.weights / 2**30)

    def generate(self, prompts: list[list[int]], new_tokens: int,
                 adapters: list) -> dict:
        """Seconds for ``prompts`` (each on its adapter, (name, id, path)
        or None), their ids and the compilations it caused."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest
        loras = [LoRARequest(*a) if a else None for a in adapters]
        before = compile_count()
        start = time.perf_counter()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(max_tokens=new_tokens, temperature=0,
                           ignore_eos=True),
            lora_request=loras if any(loras) else None, use_tqdm=False)
        seconds = time.perf_counter() - start
        return dict(seconds=seconds,
                    ids=[list(o.outputs[0].token_ids) for o in outs],
                    compiles=compile_count() - before)

    def rss_gib(self) -> float:
        import psutil
        return psutil.Process().memory_info().rss / 2**30

    def load_while_decoding(self, prompts: list[list[int]],
                            new_tokens: int, running: tuple,
                            loaded: tuple, new: tuple) -> dict:
        """``prompts`` decode on the adapter ``running``; a third of the
        way in, a one-token request arrives on ``loaded`` (already in
        memory): a prefill between two of their tokens; two thirds in,
        one on ``new``, which the request's arrival loads (read,
        checked, then copied into a slot by the next step).  The running
        rows' median gap between tokens, and the gaps across each
        arrival."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest
        engine = self.llm.llm_engine
        params = SamplingParams(max_tokens=new_tokens, temperature=0,
                                ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"running-{i}",
                               TokensPrompt(prompt_token_ids=prompt), params,
                               lora_request=LoRARequest(*running))
        arrivals = {new_tokens // 3: ("prefill", loaded),
                    2 * new_tokens // 3: ("load", new)}
        before = compile_count()
        times, marks, load_s = [], {}, None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if not any(o.request_id == "running-0" for o in outs):
                continue
            times.append(time.perf_counter())
            event = arrivals.pop(len(times), None)
            if event:
                kind, adapter = event
                start = time.perf_counter()
                engine.add_request(
                    kind, TokensPrompt(prompt_token_ids=prompts[0][:8]),
                    SamplingParams(max_tokens=1),
                    lora_request=LoRARequest(*adapter))
                if kind == "load":
                    load_s = time.perf_counter() - start
                marks[kind] = len(times)
        gaps = [b - a for a, b in zip(times, times[1:])]
        return dict(load_s=load_s, median_gap_s=statistics.median(gaps),
                    prefill_gap_s=gaps[marks["prefill"] - 1],
                    load_gap_s=gaps[marks["load"] - 1],
                    compiles=compile_count() - before)


def write_adapters(model: str, root: Path, rank: int) -> list[tuple]:
    """SLOTS + 1 adapters of ``model``: (name, id, folder) each."""
    from spyre_support.tiny_lora import write_random_adapter
    out = []
    for i in range(1, SLOTS + 2):
        folder = write_random_adapter(Path(model), root / f"adapter{i}",
                                      seed=i, rank=rank)
        out.append((f"adapter{i}", i, str(folder)))
    return out


def decode_once(child: Child, prompts, new_tokens: int,
                adapters) -> tuple[float, int]:
    """Decode tokens/s of ``prompts`` (G tokens against 1), and the
    compilations during them."""
    full = child.call("generate", prompts, new_tokens, adapters)
    first = child.call("generate", prompts, 1, adapters)
    decode_s = full["seconds"] - first["seconds"]
    return (len(prompts) * (new_tokens - 1) / decode_s,
            full["compiles"] + first["compiles"])


def main() -> int:
    ap = benchmark_parser(__doc__, backend=True)
    add_shape_options(ap)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    add_json_option(ap, "lora.json")
    args = ap.parse_args()
    sizes = parse_ints(args.batch_sizes)
    largest = max(sizes)
    ids = text_ids(args.model)
    env = cb_env(args.backend)
    base_args = dict(model_impl="vllm", dtype=args.dtype,
                     max_num_seqs=largest,
                     max_model_len=cb_max_model_len(args.prompt_len,
                                                    args.new_tokens))
    lora_args = dict(base_args, enable_lora=True, max_loras=SLOTS,
                     max_lora_rank=args.rank, max_cpu_loras=SLOTS + 1)
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    rows, result = [], dict(args=vars(args), machine=machine_info())
    compiles = 0
    try:
        print(f"[adapters] writing {SLOTS + 1} of rank {args.rank} ...",
              flush=True)
        adapters = write_adapters(args.model, root, args.rank)
        runs = {}
        engines = [("base", base_args, {})]
        if args.backend == "inductor":
            # The LoRA engine's graphs read the weights as inputs (freezing
            # would fold the adapters' tensors): the base so too, to tell
            # the two costs apart.
            engines.append(("base-inputs", base_args,
                            {"VLLM_SPYRE_INDUCTOR_FREEZING": "0"}))
        engines.append(("lora", lora_args, {}))
        children: dict = {}
        try:
            for name, engine_args, extra_env in engines:
                print(f"[{name}] starting ...", flush=True)
                children[name] = Child(name, Runner, args.model, engine_args,
                                       env=dict(env, **extra_env))
                result[name] = children[name].result()
            plans = []  # (engine, B, plan, prompts, each row's adapter)
            for name in children:
                for b in sizes:
                    prompts = build_prompts(ids, b, args.prompt_len)
                    rows_of = {"none": [None] * b}
                    if name == "lora":
                        rows_of = {"one adapter": [adapters[0]] * b}
                        if b == largest and b > 1:
                            rows_of[f"{SLOTS} adapters"] = [
                                adapters[i % SLOTS] for i in range(b)]
                    plans += [(name, b, plan, prompts, on)
                              for plan, on in rows_of.items()]
            for name, _, _, prompts, on in plans:
                # Warm: loads the adapters, runs every graph.
                children[name].call("generate", prompts, 2, on)
            # The engines take turns, repetition by repetition, so that
            # each ratio compares rates from the same minutes (this
            # machine's speed drifts by a tenth from minute to minute).
            rates: dict = {}
            for _ in range(args.repetitions):
                for name, b, plan, prompts, on in plans:
                    rate, compiled = decode_once(children[name], prompts,
                                                 args.new_tokens, on)
                    rates.setdefault((name, b, plan), []).append(rate)
                    compiles += compiled
            runs = {key: dict(tok_s=statistics.median(values))
                    for key, values in rates.items()}
            if largest > 1:
                # One slot of the batch left for the arriving requests.
                run = children["lora"].call(
                    "load_while_decoding",
                    build_prompts(ids, largest - 1, args.prompt_len),
                    args.new_tokens, adapters[0], adapters[1], adapters[-1])
                compiles += run.pop("compiles")
                result["load_while_decoding"] = run
            # After every run: the LoRA engine holds all its adapters.
            for name, child in children.items():
                result[name]["end_rss_gib"] = child.call("rss_gib")
        finally:
            for child in children.values():
                child.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def over(name, b, run):
        base = runs.get((name, b, "none"))
        return base["tok_s"] / run["tok_s"] if base else None

    for (name, b, plan), run in runs.items():
        ratio = over("base", b, run) if name == "lora" else None
        inputs = over("base-inputs", b, run) if name == "lora" else None
        rows.append([name, b, plan, f"{run['tok_s']:.1f}",
                     f"{ratio:.2f}x" if ratio else "",
                     f"{inputs:.2f}x" if inputs else ""])
        result.setdefault("runs", []).append(dict(
            engine=name, batch=b, adapters=plan, decode_tok_s=run["tok_s"],
            step_over_base=ratio, step_over_base_inputs=inputs))
    result["compiles"] = compiles
    # The adapters' memory: the LoRA engine's growth over the base's, on
    # inductor over the base with its weights as inputs (graphs set up
    # as the LoRA engine's are).
    ref = "base-inputs" if "base-inputs" in result else "base"
    base, lora = result[ref], result["lora"]
    grew = lora["end_rss_gib"] - base["end_rss_gib"]
    counted = lora["estimated_weights_gib"] - base["estimated_weights_gib"]
    result["adapters_gib"] = dict(measured=grew, counted=counted,
                                  against=ref)
    write_json(args.json, result)
    print(f"\nmodel {Path(args.model).name} ({args.dtype}), backend "
          f"{args.backend}, continuous batching, rank {args.rank} adapters "
          f"on every projection, P={args.prompt_len} G={args.new_tokens}, "
          f"{cores()} cores")
    print(table(["engine", "B", "adapters", "decode tok/s",
                 "step / base step", "step / base-inputs step"], rows))
    print(f"\nresident after warm-up: {ref} {base['rss_gib']:.3f} GiB, "
          f"lora {lora['rss_gib']:.3f} GiB; at the end (every adapter "
          f"loaded): {ref} {base['end_rss_gib']:.3f} GiB, lora "
          f"{lora['end_rss_gib']:.3f} GiB (+{grew:.3f}); the memory check "
          f"counts the adapters as {counted:.3f} GiB "
          f"({counted / grew if grew > 0 else float('nan'):.2f}x the "
          f"growth)")
    run = result.get("load_while_decoding")
    if run:
        print(f"\nloading a new adapter while {largest - 1} requests decode "
              f"on another: {run['load_s'] * 1e3:.1f} ms at its request's "
              f"arrival; the running requests' gap between tokens: median "
              f"{run['median_gap_s'] * 1e3:.1f} ms, "
              f"{run['prefill_gap_s'] * 1e3:.1f} ms across a request's "
              f"arrival on a loaded adapter (its prefill), "
              f"{run['load_gap_s'] * 1e3:.1f} ms across one on the new "
              f"adapter (the load, the copy into a slot, the prefill)")
    return 1 if compiled_in_timed_runs(compiles) else 0


if __name__ == "__main__":
    sys.exit(main())
