"""Hugging Face transformers as the reference every Spyre output is
compared to: greedy ids and their log-probabilities, and prompt
log-probabilities."""
from __future__ import annotations

from pathlib import Path


class HFReference:
    """Greedy generation with Hugging Face transformers, one prompt at a
    time, no padding."""

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32,
                attn_implementation="sdpa").eval()
        except ValueError as e:
            # transformers refuses SDPA for attention it cannot express
            # (GPT-OSS's sinks): its eager attention is the reference.
            if "scaled_dot_product_attention" not in str(e):
                raise
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32,
                attn_implementation="eager").eval()

    def greedy(self, prompt_ids: list[int],
               max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Token ids and their log-probabilities, EOS ignored."""
        import torch
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model.generate(ids,
                                      attention_mask=torch.ones_like(ids),
                                      max_new_tokens=max_new_tokens,
                                      min_new_tokens=0,
                                      do_sample=False,
                                      eos_token_id=None,
                                      pad_token_id=0,
                                      output_logits=True,
                                      return_dict_in_generate=True)
        new = out.sequences[0, len(prompt_ids):].tolist()
        logprobs = [
            torch.log_softmax(step[0].float(), dim=-1)[tok].item()
            for step, tok in zip(out.logits, new)
        ]
        return new, logprobs


def assert_prompt_logprobs_equal(out, model, prompt: list[int],
                                 atol: float = 1e-3) -> None:
    """The ``prompt_logprobs`` of ``out`` (a ``RequestOutput`` of
    ``prompt``) equal the log-softmax of ``model``'s (transformers') logits
    over the whole prompt, at every position after the first."""
    import torch
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    n = len(prompt)
    ref = torch.log_softmax(logits, -1)[torch.arange(n - 1),
                                        torch.tensor(prompt[1:])]
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob
                        for i in range(1, n)])
    assert torch.allclose(got, ref, atol=atol), (got - ref).abs().max()


def prompt_logprobs_match_transformers(llm, model_dir, prompt: list[int],
                                       atol: float = 1e-3) -> None:
    """``prompt_logprobs=1`` of ``prompt`` from ``llm`` equal the
    log-softmax of transformers' logits over the whole prompt, at every
    position after the first."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams, TokensPrompt
    (out, ) = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
        use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir,
                                                 dtype=torch.float32)
    assert_prompt_logprobs_equal(out, model, prompt, atol)
