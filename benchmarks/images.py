"""Images in, text out: time to first token and decode speed of a
vision-language model on Spyre against transformers on the same
checkpoint.

For each image size: one request of the image and a short question, its
time to first token (``max_tokens=1``), split into the vision tower, the
projector (each timed by hooks on the model's modules) and the rest (the
language model's prefill, and the engine's work around it); then decode
tokens/s at each batch size, B requests of the image, timed with N new
tokens and with 1 (so that prefills are excluded).  Spyre runs in this
process, continuous batching, ``--max-num-seqs`` the largest batch;
transformers runs ``generate`` on the same checkpoint (its processor's
batch, greedy).  Both in ``--dtype``; the best of ``--repetitions``.

    python benchmarks/images.py [--model models/bench/smol-vision-bf16]
        [--image-sizes 224x224,448x448] [--batch-sizes 1,8]
        [--new-tokens 32] [--dtype bfloat16] [--backend inductor]
        [--max-model-len 4096]

``scripts/vision_checkpoints.py`` writes the checkpoints (random weights
at a LLaVA-NeXT's shapes).
"""
from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

from spyre_support.bench import RESULTS, machine_info, write_json
from spyre_support.engines import compile_count, spyre_llm
from spyre_support.envs import cb_env
from spyre_support.paths import REPO
from spyre_support.tiny_vision import image

QUESTION = "<image>\nDescribe the picture in one sentence."


class Hooks:
    """Seconds spent in the vision tower and the projector."""

    def __init__(self, model) -> None:
        self.seconds = {"vision tower": 0.0, "projector": 0.0}
        self.handles = []
        for name, module in (("vision tower", model.vision_tower),
                             ("projector", model.multi_modal_projector)):
            self.handles.append(module.register_forward_pre_hook(
                lambda *_, n=name: self._start(n)))
            self.handles.append(module.register_forward_hook(
                lambda *_, n=name: self._stop(n)))
        self._began: dict[str, float] = {}

    def _start(self, name: str) -> None:
        self._began[name] = time.perf_counter()

    def _stop(self, name: str) -> None:
        self.seconds[name] += time.perf_counter() - self._began[name]

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def best(runs: list[dict], key: str) -> dict:
    return min(runs, key=lambda r: r[key])


def measure(generate, hooks: Hooks, sizes, batches, new_tokens: int,
            repetitions: int) -> dict:
    """TTFT and its split per image size; decode tokens/s per batch."""
    out = {}
    for w, h in sizes:
        picture = image(w, h, seed=w * h)
        firsts = []
        for _ in range(repetitions):
            hooks.reset()
            start = time.perf_counter()
            generate([picture], 1)
            firsts.append(dict(ttft=time.perf_counter() - start,
                               **hooks.seconds))
        first = best(firsts, "ttft")
        decode = {}
        for batch in batches:
            pictures = [image(w, h, seed=w * h + i) for i in range(batch)]
            rates = []
            for _ in range(repetitions):
                start = time.perf_counter()
                generate(pictures, 1)
                one = time.perf_counter() - start
                start = time.perf_counter()
                generate(pictures, new_tokens)
                many = time.perf_counter() - start
                rates.append(batch * (new_tokens - 1) / max(many - one,
                                                            1e-9))
            decode[batch] = max(rates)
        out[f"{w}x{h}"] = dict(first, decode=decode)
    return out


def spyre(args, sizes, batches) -> dict:
    from vllm import SamplingParams
    with spyre_llm(Path(args.model), cb_env(args.backend),
                   max_num_seqs=max(batches),
                   max_model_len=args.max_model_len,
                   dtype=args.dtype) as llm:
        runner = llm.llm_engine.model_executor.driver_worker.worker \
            .model_runner
        hooks = Hooks(runner.model.code.vllm_model)

        def generate(pictures, tokens):
            llm.generate([{"prompt": QUESTION,
                           "multi_modal_data": {"image": p}}
                          for p in pictures],
                         SamplingParams(temperature=0, max_tokens=tokens,
                                        ignore_eos=True), use_tqdm=False)

        generate([image(*sizes[0])], 2)
        before = compile_count()
        result = measure(generate, hooks, sizes, batches, args.new_tokens,
                         args.repetitions)
        if compile_count() != before:
            raise SystemExit("Spyre compiled a graph while timed")
        return result


def transformers_peer(args, sizes, batches) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    dtype = getattr(torch, args.dtype)
    processor = AutoProcessor.from_pretrained(args.model)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(
        args.model, torch_dtype=dtype).eval()
    hooks = Hooks(model.model)

    def generate(pictures, tokens):
        inputs = processor(images=pictures,
                           text=[QUESTION] * len(pictures),
                           return_tensors="pt", padding=True)
        inputs.pop("token_type_ids", None)
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False)

    return measure(generate, hooks, sizes, batches, args.new_tokens,
                   args.repetitions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model",
                    default=str(REPO / "models/bench/smol-vision-bf16"))
    ap.add_argument("--image-sizes", default="224x224,448x448")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="inductor",
                    choices=["inductor", "eager"])
    ap.add_argument("--repetitions", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="Spyre's: the largest image's tokens and more")
    ap.add_argument("--no-peer", action="store_true",
                    help="Spyre only")
    ap.add_argument("--json", default=str(RESULTS / "images.json"))
    args = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split("x"))
             for s in args.image_sizes.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results = {"spyre": spyre(args, sizes, batches)}
    if not args.no_peer:
        results["transformers"] = transformers_peer(args, sizes, batches)
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               results=results))
    print(f"\nmodel {args.model} ({args.dtype}), Spyre on {args.backend}, "
          f"continuous batching; {args.new_tokens} new tokens, best of "
          f"{args.repetitions}")
    head = ("image", "engine", "TTFT s", "vision tower s", "projector s",
            "rest s", *[f"decode tok/s B={b}" for b in batches])
    print("  ".join(head))
    for size in results["spyre"]:
        for engine, runs in results.items():
            r = runs[size]
            rest = r["ttft"] - r["vision tower"] - r["projector"]
            print("  ".join([size, engine, f"{r['ttft']:.3f}",
                             f"{r['vision tower']:.3f}",
                             f"{r['projector']:.3f}", f"{rest:.3f}",
                             *[f"{r['decode'][b]:.1f}" for b in batches]]))
        if "transformers" in results:
            s, t = results["spyre"][size], results["transformers"][size]
            ratios = [f"{s['decode'][b] / t['decode'][b]:.2f}x"
                      for b in batches]
            print("  ".join([size, "Spyre/transformers",
                             f"{t['ttft'] / s['ttft']:.2f}x faster", "",
                             "", "", *ratios]))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
