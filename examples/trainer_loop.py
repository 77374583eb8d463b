"""A trainer and a Spyre vLLM engine in one job: generate, train, push the
new weights into the engine in place, generate again.

Each process holds a transformers copy of the model that it trains (a few
steps of supervised fine-tuning on one sentence) and a ``vllm.LLM`` on the
Spyre backend built with ``distributed_executor_backend="external_launcher"``
in the same process.  After every step the trainer's state dict goes into
the engine with ``LLM.collective_rpc("update_weights_in_place", ...)``:
nothing is recompiled, and the engine's next greedy completion is checked
against the trainer: each token must be the trainer's own greedy choice.

    python examples/trainer_loop.py [--model DIR] [--steps N]
    torchrun --nproc-per-node 3 examples/trainer_loop.py --model DIR

Under torchrun the ranks form the engine's tensor-parallel group (each
engine keeps its shard of the pushed weights).  Every rank trains a
replica, then takes rank 0's weights before the push, as a data-parallel
job's replicas agree after their all-reduce: two ranks' own steps may
differ in the last bits, and Adam's first steps turn such a difference
into a whole step's size.  (A real job would wrap the trainer in DDP or
FSDP and push the gathered weights.)  Rank 0 prints.  The Spyre
settings come from the environment; the defaults below keep the run
short on a 2-core CPU.
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
# Float32 logits of the same weights differ by far less than this; a
# token that is not the trainer's choice loses by far more.
TIE = 1e-3


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

    def take_rank0_weights() -> None:
        if world > 1:
            with torch.no_grad():
                for tensor in trainer.state_dict().values():
                    torch.distributed.broadcast(tensor, src=0)

    def trainer_agrees(ids: list[int]) -> str:
        """'True' if the engine's ids are the trainer's greedy choice at
        every position, up to rounding: with the engine's ids fed in, each
        one's logit is within ``TIE`` of the trainer's best.  (A
        tensor-parallel engine sums its shards in another order than the
        trainer's matmul, so an exact tie between two tokens may go either
        way.)  Otherwise 'False' and the first position that is not."""
        trainer.eval()
        with torch.no_grad():
            logits = trainer(torch.tensor([prompt + ids])).logits[0]
        logits = logits[len(prompt) - 1:-1]
        chosen = logits.gather(-1, torch.tensor(ids)[:, None])[:, 0]
        best, best_ids = logits.max(-1)
        behind = (best - chosen > TIE).nonzero()
        if not len(behind):
            return "True"
        i = int(behind[0, 0])
        return (f"False (token {i}: the engine's {ids[i]} is "
                f"{float(best[i] - chosen[i]):.4f} below the trainer's "
                f"{int(best_ids[i])})")

    ids = engine_ids()
    say(f"before training: {tokenizer.decode(ids)!r}")
    for step in range(1, args.steps + 1):
        trainer.train()
        loss = trainer(lesson, labels=lesson).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        take_rank0_weights()

        start = time.perf_counter()
        llm.collective_rpc("update_weights_in_place",
                           args=(trainer.state_dict(), ))
        pushed = time.perf_counter() - start
        ids = engine_ids()
        agrees = trainer_agrees(ids)
        say(f"step {step}: loss {loss.item():.3f}, weights pushed in "
            f"{pushed:.2f} s, engine: {tokenizer.decode(ids)!r}, "
            f"trainer agrees: {agrees}")


if __name__ == "__main__":
    main()
