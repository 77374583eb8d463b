"""Write the speculative-decoding benchmark's proposer checkpoints.

``benchmarks/speculative.py --draft DIR --speculator DIR`` measures a
draft model and an MLP speculator beside n-gram lookup; no trained
small model or speculator for the default model can be had offline, so
this script writes them from what is here:

* ``draft``: the first ``--layers`` decoder layers of ``--model``, with
  its embedding, final norm and head (a layer-skipping draft: the same
  tokenizer, a fraction of the weights read per token);
* ``speculator``: an MLP speculator (``MLPSpeculator``'s layout, ``n_predict``
  stages of ``--inner-dim``) for ``--model``'s hidden size and vocabulary,
  random, or with ``--train-tokens N`` trained on ``--model``'s own hidden
  states and greedy tokens for the instructions of ``TRAIN_PROMPTS``
  (none of which the benchmark asks), each stage to predict the token
  ``i + 2`` positions after its state.

    python scripts/speculative_checkpoints.py draft --model DIR --layers 10
        --out models/bench/smollm2-draft-10l
    python scripts/speculative_checkpoints.py speculator --model DIR
        [--train-tokens 20000] --out models/bench/smollm2-speculator
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")
TRAIN_PROMPTS = [
    "Describe how {x} works, step by step.",
    "Give three facts about {x}.",
    "Write a short poem about {x}.",
    "What are the advantages and drawbacks of {x}?",
    "Summarise the history of {x} in a paragraph.",
    "Explain {x} to a ten-year-old.",
    "Write a product description for {x}.",
    "List five questions a student might ask about {x}, with answers.",
]
SUBJECTS = ["a bicycle", "photosynthesis", "a steam engine", "the moon",
            "volcanoes", "a refrigerator", "the printing press", "bees",
            "a compass", "rainbows", "a violin", "glaciers", "bread",
            "a telescope", "coral reefs", "a windmill", "the internet",
            "a sailboat", "earthquakes", "a camera"]


def write_draft(model: Path, layers: int, out: Path) -> None:
    """The first ``layers`` decoder layers of a Hugging Face Llama-style
    checkpoint (``model.layers.<i>.``), the rest of its tensors kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    config = json.loads((model / "config.json").read_text())
    if layers >= config["num_hidden_layers"]:
        sys.exit(f"--layers {layers}: {model} has "
                 f"{config['num_hidden_layers']} layers")
    config["num_hidden_layers"] = layers
    tensors = {}
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                parts = name.split(".")
                if parts[:2] == ["model", "layers"] and \
                        int(parts[2]) >= layers:
                    continue
                tensors[name] = f.get_tensor(name)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(model, out)


def _copy_tokenizer(model: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (model / name).exists():
            shutil.copy(model / name, out / name)


def answers(model: Path, count: int, out: Path,
            new_tokens: int = 160) -> None:
    """Writes ``model``'s greedy answers (prompt and answer token ids) to
    the first ``count`` instructions of ``TRAIN_PROMPTS`` as JSON, served
    by vLLM on Spyre's CPU backend (continuous batching)."""
    import os
    os.environ.setdefault("VLLM_SPYRE_USE_CB", "1")
    os.environ.setdefault("VLLM_SPYRE_DYNAMO_BACKEND", "eager")
    from vllm import LLM, SamplingParams
    llm = LLM(str(model), max_num_seqs=8, max_model_len=512)
    prompts = [[{"role": "user", "content": p.format(x=s)}]
               for s in SUBJECTS for p in TRAIN_PROMPTS][:count]
    outs = llm.chat(prompts, SamplingParams(temperature=0,
                                            max_tokens=new_tokens),
                    use_tqdm=False)
    out.write_text(json.dumps([
        list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        for o in outs]))


def training_data(model: Path, tokens: int):
    """``model``'s last hidden states (after its final norm) and token ids
    over its greedy answers to ``TRAIN_PROMPTS``: per answer, ``[n - 1,
    hidden]`` and ``[n]``, state ``j`` the one whose logits gave token
    ``j + 1``."""
    import subprocess
    import tempfile

    from transformers import AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "answers.json"
        subprocess.run([sys.executable, __file__, "answers", "--model",
                        str(model), "--out", str(path), "--train-tokens",
                        str(tokens)], check=True)
        seqs = json.loads(path.read_text())
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    states, ids = [], []
    with torch.no_grad():
        for seq in seqs:
            seq = torch.tensor([seq])
            states.append(lm.model(seq).last_hidden_state[0, :-1])
            ids.append(seq[0])
    print(f"  {sum(len(i) for i in ids)} tokens in {len(ids)} answers")
    return states, ids


def train(module, states, ids, epochs: int, lr: float = 1e-2,
          batch: int = 256) -> None:
    """Stage ``i`` from state ``j`` and token ``j + 1 + i`` predicts token
    ``j + 2 + i`` (teacher forcing), cross-entropy summed over stages, in
    shuffled batches of positions; the heads start small."""
    stages = module.max_speculative_tokens
    mix = module.emb_weight / module.state_weight
    xs, tin, tout = [], [], []
    for hidden, seq in zip(states, ids):
        n = hidden.shape[0] - stages
        if n <= 0:
            continue
        xs.append(hidden[:n])
        tin.append(torch.stack([seq[1 + i:1 + i + n] for i in range(stages)],
                               1))
        tout.append(torch.stack([seq[2 + i:2 + i + n]
                                 for i in range(stages)], 1))
    x, tin, tout = torch.cat(xs), torch.cat(tin), torch.cat(tout)
    with torch.no_grad():
        for head in module.head:
            head.weight.normal_(0, 0.02)
        for emb in module.emb:
            emb.weight.normal_(0, 1)
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    for epoch in range(epochs):
        total, count = [0.0] * stages, 0
        for rows in torch.randperm(len(x), generator=gen).split(batch):
            state = x[rows]
            if module.scale_input:
                state = module.ln0(state) / 2**0.5
            losses = []
            for i in range(stages):
                z = module.emb[i](tin[rows, i])
                state = module.activation(
                    module.ln[i](module.proj[i](state) + mix * z))
                losses.append(torch.nn.functional.cross_entropy(
                    state @ module.head[i].weight.t(), tout[rows, i]))
            opt.zero_grad()
            sum(losses).backward()
            opt.step()
            total = [t + float(v.detach()) for t, v in zip(total, losses)]
            count += 1
        print(f"  epoch {epoch + 1}: loss per stage " + ", ".join(
            f"{t / count:.2f}" for t in total), flush=True)


def write_speculator(model: Path, out: Path, n_predict: int,
                     inner_dim: int, train_tokens: int, epochs: int) -> None:
    from safetensors.torch import save_file
    from spyre_support.tiny_models import build_tiny_mlp_speculator
    build_tiny_mlp_speculator(out, model, n_predict=n_predict,
                              inner_dim=inner_dim, seed=0)
    if not train_tokens:
        return
    module = _load_speculator(out)
    print(f"Collecting {train_tokens} tokens of {model}'s answers ...")
    states, ids = training_data(model, train_tokens)
    start = time.perf_counter()
    with torch.enable_grad():
        train(module, states, ids, epochs)
    print(f"  trained in {time.perf_counter() - start:.0f} s")
    save_file({k: v.detach().contiguous()
               for k, v in module.state_dict().items()},
              str(out / "model.safetensors"))


def _load_speculator(folder: Path):
    """vLLM's ``MLPSpeculator`` of ``folder``, on one rank."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from vllm.distributed import (ensure_model_parallel_initialized,
                                  init_distributed_environment)
    from vllm.model_executor.models.mlp_speculator import MLPSpeculator
    from vllm.transformers_utils.configs import MLPSpeculatorConfig
    from vllm.utils import get_open_port
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
    ensure_model_parallel_initialized(1, 1)
    config = SimpleNamespace(model_config=SimpleNamespace(
        hf_config=MLPSpeculatorConfig.from_pretrained(folder)))
    module = MLPSpeculator(vllm_config=config)
    module.load_weights(load_file(str(folder / "model.safetensors")).items())
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["draft", "speculator", "answers"])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--n-predict", type=int, default=4)
    ap.add_argument("--inner-dim", type=int, default=256)
    ap.add_argument("--train-tokens", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args()
    if args.kind == "answers":  # the speculator's training data
        answers(args.model, max(args.train_tokens // 200, 8), args.out)
        return 0
    if (args.out / "config.json").exists():
        print(f"{args.out} is written already")
        return 0
    start = time.perf_counter()
    if args.kind == "draft":
        write_draft(args.model, args.layers, args.out)
    else:
        write_speculator(args.model, args.out, args.n_predict,
                         args.inner_dim, args.train_tokens, args.epochs)
    print(f"Wrote {args.out} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
