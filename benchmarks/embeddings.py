"""Embeddings per second: our Spyre engine against sentence-transformers.

The same texts go to both engines, each in its own process with the same
intra-op threads: for each text length (tokens, the tokenizer's markers
included) and batch size B, B texts per call (``LLM.embed`` /
``SentenceTransformer.encode``), enough calls for ``--texts`` texts, the
engines alternated (the order flipped every repetition).  A text is a
window of the benchmark text (``data/text.txt``) at most that many tokens
long; both engines tokenize it themselves.

Our engine gets the warm-up shapes an operator would configure for this
workload (``shapes``): for each length and batch size, the rows of 64 or
more slots that hold B texts, several short texts packed to a row.
Ours runs once per ``--dtypes`` entry (``float32``, and ``bfloat16``:
every matrix product in bfloat16, the rest float32); sentence-transformers
runs in float32 (``st``, the reference) and, per ``--st-dtypes``, with the
whole model in bfloat16 (``st-bfloat16``, the peer at equal product
precision).  Reported per (length, B): embeddings/s of each engine
(median over the repetitions), ours / sentence-transformers float32, ours
/ sentence-transformers at our dtype, the dynamo compilations in our
timed calls (must be 0) and each engine's smallest cosine similarity with
sentence-transformers float32.

    python benchmarks/embeddings.py [--model DIR] [--backend inductor]
        [--dtypes float32,bfloat16] [--st-dtypes float32,bfloat16]
        [--batch-sizes 1,8,32] [--text-lens 32,256] [--texts 64]
        [--repetitions 3] [--json PATH] [--plot PATH]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from spyre_support.bench import (Child, RESULTS, TEXT, cores, machine_info,
                                 parse_ints, table, write_json)
from spyre_support.engines import compile_count
from spyre_support.paths import REPO

DEFAULT_EMBEDDER = str(REPO / "models" / "all-MiniLM-L6-v2")
ENGINES = ("st", "spyre")


def shapes(text_lens: list[int], batch_sizes: list[int]) -> dict[str, str]:
    """Warm-up shapes holding B texts of each length: rows of the length
    rounded up to a multiple of 64, as many texts to a row as fit, as few
    rows as hold B of them."""
    pairs = set()
    for n in text_lens:
        row = -(-n // 64) * 64
        per_row = row // n
        for b in batch_sizes:
            pairs.add((row, -(-b // per_row)))
    pairs = sorted(pairs)
    return {"VLLM_SPYRE_WARMUP_PROMPT_LENS": ",".join(str(p) for p, _ in
                                                      pairs),
            "VLLM_SPYRE_WARMUP_BATCH_SIZES": ",".join(str(b) for _, b in
                                                      pairs)}


def texts_of(model: str, length: int, count: int) -> list[str]:
    """``count`` windows of the benchmark text, each at most ``length``
    tokens once tokenized with the model's markers."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    words = TEXT.read_text().split()
    out, start = [], 0
    while len(out) < count:
        take = length
        while True:
            text = " ".join(words[start:start + take])
            if len(tok(text)["input_ids"]) <= length:
                break
            take -= 1
        out.append(text)
        start = (start + 7 * take) % max(1, len(words) - 4 * length)
    return out


class SpyreEmbedder:
    """Lives in a child: our engine, ``LLM(task="embed")``."""

    def __init__(self, model: str, dtype: str) -> None:
        from vllm import LLM
        start = time.perf_counter()
        self.llm = LLM(model=model, task="embed", dtype=dtype)
        self.startup_s = time.perf_counter() - start

    def info(self) -> dict:
        return {"startup_s": self.startup_s}

    def run(self, texts: list[str], batch: int) -> dict:
        before = compile_count()
        start = time.perf_counter()
        vectors = []
        for i in range(0, len(texts), batch):
            out = self.llm.embed(texts[i:i + batch], use_tqdm=False)
            vectors += [o.outputs.embedding for o in out]
        seconds = time.perf_counter() - start
        return dict(seconds=seconds, compiles=compile_count() - before,
                    vectors=vectors)


class STEmbedder:
    """Lives in a child: sentence-transformers on the CPU, the whole model
    in ``dtype``."""

    def __init__(self, model: str, dtype: str = "float32") -> None:
        import torch
        from sentence_transformers import SentenceTransformer
        start = time.perf_counter()
        self.model = SentenceTransformer(
            model, device="cpu",
            model_kwargs={"torch_dtype": getattr(torch, dtype)})
        self.startup_s = time.perf_counter() - start

    def info(self) -> dict:
        return {"startup_s": self.startup_s}

    def run(self, texts: list[str], batch: int) -> dict:
        start = time.perf_counter()
        vectors = []
        for i in range(0, len(texts), batch):
            vectors += self.model.encode(
                texts[i:i + batch], batch_size=batch,
                convert_to_tensor=True).float().tolist()
        return dict(seconds=time.perf_counter() - start, compiles=0,
                    vectors=vectors)


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    import torch
    return torch.nn.functional.cosine_similarity(
        torch.tensor(a), torch.tensor(b), dim=1).min().item()


def measure(children: dict, args, text_lens, batch_sizes) -> list[dict]:
    """Per (length, batch): each engine's median embeddings/s, ours over
    sentence-transformers, our compilations and agreement."""
    rows = []
    for n in text_lens:
        texts = texts_of(args.model, n, args.texts)
        for b in batch_sizes:
            runs: dict[str, list[dict]] = {e: [] for e in children}
            for rep in range(args.repetitions + 1):  # the first: untimed
                order = list(children) if rep % 2 else list(children)[::-1]
                for name in order:
                    result = children[name].call("run", texts, b)
                    if rep:
                        runs[name].append(result)
            row = dict(text_len=n, batch=b, emb_s={}, ratio={},
                       ratio_same_dtype={}, compiles={}, min_cosine={})
            for e in children:
                row["emb_s"][e] = statistics.median(
                    len(texts) / r["seconds"] for r in runs[e])
                if e != "st":
                    row["min_cosine"][e] = min_cosine(
                        runs[e][0]["vectors"], runs["st"][0]["vectors"])
            for e in ours(children):
                row["ratio"][e] = row["emb_s"][e] / row["emb_s"]["st"]
                peer = same_dtype_peer(e, children)
                if peer is not None:
                    row["ratio_same_dtype"][e] = (row["emb_s"][e] /
                                                  row["emb_s"][peer])
                row["compiles"][e] = sum(r["compiles"] for r in runs[e])
            rows.append(row)
            print(f"length {n}, batch {b}: " + ", ".join(
                f"{e} {v:.1f}" for e, v in row["emb_s"].items()) +
                  " emb/s", flush=True)
    return rows


def ours(children) -> list[str]:
    return [e for e in children if e.startswith("spyre")]


def st_name(dtype: str) -> str:
    """sentence-transformers' engine name: ``st`` in float32 (the
    reference), ``st-<dtype>`` otherwise."""
    return "st" if dtype == "float32" else f"st-{dtype}"


def same_dtype_peer(engine: str, children) -> str | None:
    """sentence-transformers at our engine's dtype, if it runs."""
    peer = st_name(engine.split("-", 1)[1])
    return peer if peer in children else None


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lens = sorted({r["text_len"] for r in rows})
    engines = list(rows[0]["emb_s"])
    labels = {"st": "sentence-transformers (float32)",
              "st-bfloat16": "sentence-transformers (bfloat16)"}
    fig, axes = plt.subplots(1, len(lens), figsize=(5.5 * len(lens), 4))
    width = 0.8 / len(engines)
    for ax, n in zip(axes if len(lens) > 1 else [axes], lens):
        sel = [r for r in rows if r["text_len"] == n]
        for k, e in enumerate(engines):
            ax.bar([i + (k - (len(engines) - 1) / 2) * width
                    for i in range(len(sel))],
                   [r["emb_s"][e] for r in sel], width,
                   label=labels.get(
                       e, f"Spyre ({title}, {e.split('-', 1)[-1]})"))
        ax.set_xticks(list(range(len(sel))),
                      [f"batch {r['batch']}" for r in sel])
        ax.set_title(f"{n}-token texts")
        ax.set_ylabel("embeddings / s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_EMBEDDER)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="our engine's --dtype, one engine each: float32, "
                    "bfloat16 (matrix products in bfloat16); "
                    "sentence-transformers runs in float32")
    ap.add_argument("--st-dtypes", default="float32,bfloat16",
                    help="sentence-transformers' dtypes, one engine each "
                    "(float32, the reference, always runs)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--text-lens", default="32,256")
    ap.add_argument("--texts", type=int, default=64,
                    help="texts per timed run (a multiple of each batch)")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--json", default=str(RESULTS / "embeddings.json"))
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    text_lens, batch_sizes = parse_ints(args.text_lens), parse_ints(
        args.batch_sizes)
    env = {"VLLM_SPYRE_DYNAMO_BACKEND": args.backend, "VLLM_USE_V1": "0",
           **shapes(text_lens, batch_sizes)}
    print(f"our warm-up shapes: {env}", flush=True)
    children = {}
    for dtype in ["float32"] + [d for d in args.st_dtypes.split(",")
                                if d != "float32"]:
        children[st_name(dtype)] = Child(f"sentence-transformers-{dtype}",
                                         STEmbedder, args.model, dtype)
    for dtype in args.dtypes.split(","):
        children[f"spyre-{dtype}"] = Child(f"spyre-{dtype}", SpyreEmbedder,
                                           args.model, dtype, env=env)
    try:
        info = {name: c.result() for name, c in children.items()}
        rows = measure(children, args, text_lens, batch_sizes)
    finally:
        for c in children.values():
            c.close()
    write_json(args.json, dict(model=args.model, backend=args.backend,
                               env=env, machine=machine_info(),
                               threads=cores(), startup=info, rows=rows,
                               compilations=sum(
                                   sum(r["compiles"].values())
                                   for r in rows)))
    if args.plot:
        plot(rows, args.plot, args.backend)
    mine = ours(children)
    peers = [(e, same_dtype_peer(e, children)) for e in mine
             if same_dtype_peer(e, children) not in (None, "st")]
    print(table(
        ["text tokens", "batch"] + [f"{e} emb/s" for e in children] +
        [f"{e}/st" for e in mine] + [f"{e}/{p}" for e, p in peers] +
        ["compiles"] + [f"{e} min cosine" for e in children if e != "st"],
        [[r["text_len"], r["batch"]] +
         [f"{r['emb_s'][e]:.1f}" for e in children] +
         [f"{r['ratio'][e]:.2f}" for e in mine] +
         [f"{r['ratio_same_dtype'][e]:.2f}" for e, _ in peers] +
         [sum(r["compiles"].values())] +
         [f"{r['min_cosine'][e]:.6f}" for e in children if e != "st"]
         for r in rows]))


if __name__ == "__main__":
    main()
