"""Every field of vLLM's ``SamplingParams`` has vLLM's meaning on Spyre, in
static and in continuous batching: one test per field, each asserting the
field's effect (a test that would pass with the field ignored is not
here).  Penalties are checked against a reference that applies vLLM's
formulas to transformers' logits step by step; the rest by what the field
promises (a forced token, a banned word, a kept minimum, a truncated
prompt).  Tiny random Llama, ``eager``."""
from __future__ import annotations

import pytest

from spyre_support.engines import request_llm
from spyre_support.tiny_models import BOS_ID, EOS_ID

MAX_NEW = 10
PROMPT = [11, 42, 99, 7, 250, 31, 8]


@pytest.fixture(scope="module", params=["static", "cb"])
def llm(request, tiny_llama):
    return request_llm(tiny_llama, request.param)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        tiny_llama, dtype=torch.float32).eval()


def run(llm, params, prompts=None):
    from vllm import TokensPrompt
    prompts = prompts or [PROMPT]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        params, use_tqdm=False)


def sp(**kwargs):
    from vllm import SamplingParams
    kwargs.setdefault("max_tokens", MAX_NEW)
    kwargs.setdefault("ignore_eos", True)
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(**kwargs)


def first(llm, params, prompt=None):
    return run(llm, params, [prompt or PROMPT])[0].outputs[0]


def ids(completion) -> list[int]:
    return list(completion.token_ids)


@pytest.fixture(scope="module")
def greedy(llm):
    return first(llm, sp())


def penalized_greedy(hf, prompt, steps, presence=0.0, frequency=0.0,
                     repetition=1.0) -> list[int]:
    """Greedy decoding with vLLM's penalties (``apply_penalties``):
    repetition divides positive and multiplies negative logits of every
    token seen in the prompt or the output; frequency subtracts its count
    in the output, presence its appearing there."""
    import torch
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            vocab = logits.numel()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                    minlength=vocab).float()
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(ids)] = True
            logits = torch.where(
                seen, torch.where(logits > 0, logits / repetition,
                                  logits * repetition), logits)
            logits = logits - frequency * counts - presence * (counts > 0)
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out


# ---- sampling ----------------------------------------------------------


def test_temperature_zero_is_greedy_and_high_temperature_samples(
        llm, hf, greedy):
    assert ids(greedy) == penalized_greedy(hf, PROMPT, MAX_NEW)
    seen = {tuple(ids(first(llm, sp(temperature=1.5, seed=s))))
            for s in range(4)}
    assert len(seen) > 1


def test_seed_repeats_whatever_the_batch(llm):
    """The same seed gives the same tokens alone, again, and beside
    other (seeded and greedy) requests."""
    params = sp(temperature=1.0, seed=11)
    alone = ids(first(llm, params))
    assert ids(first(llm, params)) == alone
    batched = run(llm, [sp(), params, sp(temperature=0.8, seed=1), sp()],
                  [[5] * 20, PROMPT, [9] * 3, [17] * 40])
    assert ids(batched[1].outputs[0]) == alone


def test_top_k_one_is_greedy(llm, greedy):
    assert ids(first(llm, sp(temperature=1.5, top_k=1,
                         seed=3))) == ids(greedy)


def test_tiny_top_p_is_greedy(llm, greedy):
    """top_p keeps the fewest tokens whose probabilities reach it: at
    1e-6 only the most likely one."""
    assert ids(first(llm, sp(temperature=1.5, top_p=1e-6,
                         seed=3))) == ids(greedy)


def test_min_p_one_is_greedy(llm, greedy):
    """min_p keeps tokens at least min_p times as likely as the best."""
    assert ids(first(llm, sp(temperature=1.5, min_p=1.0,
                         seed=3))) == ids(greedy)


# ---- penalties ---------------------------------------------------------


@pytest.mark.parametrize("penalty", [
    dict(presence=1.5),
    dict(frequency=1.0),
    dict(repetition=1.8),
])
def test_penalties_follow_vllm(llm, hf, greedy, penalty):
    names = dict(presence="presence_penalty",
                 frequency="frequency_penalty",
                 repetition="repetition_penalty")
    got = first(llm, sp(**{names[k]: v for k, v in penalty.items()}))
    want = penalized_greedy(hf, PROMPT, MAX_NEW, **penalty)
    assert ids(got) == want
    assert want != ids(greedy), "the penalty changed nothing here"


# ---- which tokens may come ---------------------------------------------


def test_logit_bias_forces_a_token(llm):
    out = first(llm, sp(logit_bias={77: 100.0}))
    assert ids(out) == [77] * MAX_NEW


def test_allowed_token_ids(llm, greedy):
    allowed = [5, 6, 300]
    assert not set(ids(greedy)) <= set(allowed)
    out = first(llm, sp(allowed_token_ids=allowed))
    assert len(ids(out)) == MAX_NEW
    assert set(ids(out)) <= set(allowed)


def test_bad_words_never_appear(llm, greedy):
    tokenizer = llm.get_tokenizer()
    word = next(t for t in ids(greedy)
                if tokenizer.decode([t]).strip().isalpha()
                and tokenizer.encode(tokenizer.decode([t]),
                                     add_special_tokens=False) == [t])
    out = first(llm, sp(bad_words=[tokenizer.decode([word])]))
    assert len(ids(out)) == MAX_NEW
    assert word not in ids(out)


# ---- when to stop ------------------------------------------------------


def test_min_tokens_holds_back_eos(llm):
    """End-of-sequence forced by a bias: it ends the output at once,
    unless min_tokens asks for more first."""
    forced = dict(logit_bias={EOS_ID: 100.0}, ignore_eos=False)
    assert ids(first(llm, sp(**forced))) == [EOS_ID]
    out = first(llm, sp(**forced, min_tokens=4))
    assert EOS_ID not in ids(out)[:4]
    assert ids(out)[4:] == [EOS_ID]
    assert out.finish_reason == "stop"


def test_ignore_eos_generates_max_tokens(llm):
    out = first(llm, sp(logit_bias={EOS_ID: 100.0}, ignore_eos=True,
                        max_tokens=6))
    assert ids(out) == [EOS_ID] * 6
    assert out.finish_reason == "length"


def test_stop_token_ids(llm, greedy):
    stop_at = ids(greedy)[3]
    cut = ids(greedy).index(stop_at)
    out = first(llm, sp(stop_token_ids=[stop_at]))
    assert ids(out) == ids(greedy)[:cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(llm, greedy, include):
    text = greedy.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"greedy text too short: {text!r}"
    out = first(llm, sp(stop=[stop], include_stop_str_in_output=include))
    end = text.index(stop) + (len(stop) if include else 0)
    assert out.text == text[:end]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_max_tokens(llm, greedy):
    out = first(llm, sp(max_tokens=3))
    assert ids(out) == ids(greedy)[:3]
    assert out.finish_reason == "length"


# ---- how many completions -----------------------------------------------


def test_n_completions(llm, greedy):
    outs = run(llm, sp(n=3, temperature=1.0, top_k=1))[0].outputs
    assert [ids(o) for o in outs] == [ids(greedy)] * 3
    sampled = run(llm, sp(n=4, temperature=1.5, seed=5))[0].outputs
    assert len(sampled) == 4
    assert len({tuple(ids(c)) for c in sampled}) > 1


def test_best_of_returns_the_most_likely(llm):
    """best_of=3 samples what n=3 samples under the same seed, and
    returns the completion of the highest cumulative log-probability."""
    params = dict(temperature=1.5, seed=5, logprobs=0)
    three = run(llm, sp(n=3, **params))[0].outputs
    best = run(llm, sp(n=1, best_of=3, **params))[0].outputs
    assert len(best) == 1
    top = max(three, key=lambda o: o.cumulative_logprob)
    assert len({tuple(ids(o)) for o in three}) > 1
    assert ids(best[0]) == ids(top)
    assert best[0].cumulative_logprob == top.cumulative_logprob


# ---- what is returned ---------------------------------------------------


def test_logprobs(llm, greedy):
    out = first(llm, sp(logprobs=5))
    assert ids(out) == ids(greedy)
    for tok, step in zip(ids(out), out.logprobs):
        assert tok in step and len(step) >= 5
        assert step[tok].rank == 1


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens_in_text(llm, skip, spaces):
    """skip_special_tokens drops them from the text.  A fast tokenizer,
    like this one and every checkpoint's ``tokenizer.json``, joins them
    without spaces whatever spaces_between_special_tokens says: vLLM's
    detokenizer applies that only to slow tokenizers, on every backend."""
    out = first(llm, sp(logit_bias={BOS_ID: 100.0}, max_tokens=3,
                        skip_special_tokens=skip,
                        spaces_between_special_tokens=spaces))
    assert ids(out) == [BOS_ID] * 3
    assert out.text == ("" if skip else "<s><s><s>")


def test_truncate_prompt_tokens_keeps_the_last(llm):
    """A text prompt is cut to its last truncate_prompt_tokens tokens
    (vLLM truncates when it tokenizes; the OpenAI server does the same
    for token ids)."""
    text = ("spyre card batch token shape prompt model cache graph "
            "compile serve request decode prefill")
    tokens = llm.get_tokenizer()(text).input_ids
    assert len(tokens) > 5
    out = llm.generate([text], sp(truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == tokens[-5:]
    assert ids(out.outputs[0]) == ids(first(llm, sp(), tokens[-5:]))


# ---- refused up front ---------------------------------------------------


def test_more_samples_than_a_batch_are_refused(llm):
    with pytest.raises(ValueError, match="n=6"):
        run(llm, sp(n=6, temperature=1.5, seed=5))
    assert first(llm, sp(max_tokens=2)).token_ids
