"""A trainer and a Spyre vLLM engine in one job: generate, train, push the
new weights into the engine in place, generate again.

Each process holds a transformers copy of the model that it trains (a few
steps of supervised fine-tuning on one sentence) and a ``vllm.LLM`` on the
Spyre backend built with ``distributed_executor_backend="external_launcher"``
in the same process.  After every step the trainer's state dict goes into
the engine with ``LLM.collective_rpc("update_weights_in_place", ...)``:
nothing is recompiled, and the engine's next completion is checked against
the trainer's own greedy one.

    python examples/trainer_loop.py [--model DIR] [--steps N]
    torchrun --nproc-per-node 3 examples/trainer_loop.py --model DIR

Under torchrun the ranks form the engine's tensor-parallel group (each
engine keeps its shard of the pushed weights) and every rank trains the
same replica (a real job would wrap the trainer in DDP or FSDP and push
the gathered weights).  Rank 0 prints.  The Spyre settings come from the
environment; the defaults below keep the run short on a 2-core CPU.
"""
import argparse
import os
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / \
    "SmolLM2-135M-Instruct"

os.environ.setdefault("VLLM_SPYRE_DYNAMO_BACKEND", "eager")
# With inductor: weights stay graph inputs, so they can be updated in place.
os.environ.setdefault("VLLM_SPYRE_INDUCTOR_FREEZING", "0")
os.environ.setdefault("VLLM_SPYRE_WARMUP_PROMPT_LENS", "64")
os.environ.setdefault("VLLM_SPYRE_WARMUP_NEW_TOKENS", "12")
os.environ.setdefault("VLLM_SPYRE_WARMUP_BATCH_SIZES", "1")
os.environ.setdefault("VLLM_USE_V1", "0")

PROMPT = "The Spyre card"
LESSON = "The Spyre card serves vLLM on IBM Z and Power machines."
NEW_TOKENS = 12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm import LLM, SamplingParams

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)

    llm = LLM(model=args.model, tensor_parallel_size=world,
              distributed_executor_backend="external_launcher", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    torch.manual_seed(0)
    trainer = AutoModelForCausalLM.from_pretrained(args.model,
                                                   dtype=torch.float32)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
    lesson = tokenizer(LESSON, return_tensors="pt").input_ids
    prompt = tokenizer(PROMPT).input_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                            ignore_eos=True)

    def engine_ids() -> list[int]:
        out = llm.generate({"prompt_token_ids": prompt}, greedy,
                           use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def trainer_ids() -> list[int]:
        trainer.eval()
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = trainer.generate(ids, attention_mask=torch.ones_like(ids),
                                   max_new_tokens=NEW_TOKENS, do_sample=False,
                                   min_new_tokens=NEW_TOKENS,
                                   pad_token_id=tokenizer.eos_token_id)
        return out[0, len(prompt):].tolist()

    ids = engine_ids()
    say(f"before training: {tokenizer.decode(ids)!r}")
    for step in range(1, args.steps + 1):
        trainer.train()
        loss = trainer(lesson, labels=lesson).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        start = time.perf_counter()
        llm.collective_rpc("update_weights_in_place",
                           args=(trainer.state_dict(), ))
        pushed = time.perf_counter() - start
        ids = engine_ids()
        agrees = ids == trainer_ids()
        say(f"step {step}: loss {loss.item():.3f}, weights pushed in "
            f"{pushed:.2f} s, engine: {tokenizer.decode(ids)!r}, "
            f"trainer agrees: {agrees}")


if __name__ == "__main__":
    main()
