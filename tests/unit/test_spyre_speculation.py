"""Speculative decoding's parts, without an engine: the n-gram lookup and
its back-off, the verify step's paged inputs, and acceptance
(``SpyreSpecModelRunner._accept``) on scripted logits through vLLM's
logits processor and the Spyre sampler: a step table of proposals,
emitted tokens and counts for greedy rows, and for sampled rows the
distribution of emitted tokens against the target's."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.spyre_sampler import SpyreSampler
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceData, SequenceGroupMetadata
from vllm.worker import spyre_ngram
from vllm.worker.spyre_cb_inputs import verify_batch
from vllm.worker.spyre_runner_base import sample
from vllm.worker.spyre_spec_cost import PRIOR, VerifyCost
from vllm.worker.spyre_spec_model_runner import (SpyreSpecModelInput,
                                                 SpyreSpecModelRunner)

VOCAB = 6


# ---- the n-gram lookup ------------------------------------------------------
@pytest.mark.parametrize("tokens, k, expected", [
    # The longest suffix that occurs earlier wins: (3, 4) -> 5, 6.
    ([1, 2, 3, 4, 5, 6, 9, 3, 4], 2, [5, 6]),
    # Of its occurrences the latest: (7, 8) is followed by 1 then by 2.
    ([7, 8, 1, 0, 7, 8, 2, 0, 7, 8], 3, [2, 0, 7]),
    # Longer suffix first: (1, 2, 3) -> 9 beats (2, 3) -> 4.
    ([2, 3, 4, 1, 2, 3, 9, 5, 1, 2, 3], 1, [9]),
    # Fewer followers than k: what there is.
    ([5, 6, 7, 5, 6], 4, [7, 5, 6]),
    # No earlier occurrence of any suffix of 2 to 3 tokens.
    ([1, 2, 3, 4, 5], 4, []),
    # A single token repeated: its suffix matches itself shifted; the
    # earliest occurrence has the most followers.
    ([4, 4, 4], 2, [4]),
    ([4, 4, 4, 4, 4, 4, 4], 3, [4, 4, 4]),
    # The latest occurrence with k followers, over a later one with fewer.
    ([1, 2, 7, 8, 9, 1, 2, 6, 1, 2], 4, [7, 8, 9, 1]),
    ([1, 2, 7, 8, 9, 1, 2, 6, 1, 2], 2, [6, 1]),
    ([3], 2, []),
])
def test_propose(tokens, k, expected):
    assert spyre_ngram.propose(tokens, k, 2, 3) == expected


def test_a_sequence_whose_proposals_fail_pauses_longer_each_time():
    backoff = spyre_ngram.Backoff()
    pattern = []
    for _ in range(40):
        proposes = backoff.proposes("r")
        pattern.append(proposes)
        if proposes:
            backoff.verified("r", 0)
    # Proposing steps, then 1, 2, 4, 8, 16, 16 skipped.
    gaps = [len(run) for run in "".join("x" if p else "." for p in pattern)
            .split("x")[1:-1]]
    assert gaps == [1, 2, 4, 8, 16]
    backoff.verified("r", 1)  # an accepted proposal: no pause
    assert all(backoff.proposes("r") for _ in range(3))
    backoff.verified("r", 0)
    backoff.forget(["r"])
    assert backoff.proposes("r")


def test_a_step_verifies_when_its_expected_tokens_beat_its_cost():
    """A verify step costs 1.3 decode steps at batch 1 and 4.4 at batch 8
    (SmolLM2's, measured): one sequence proposing 4 tokens at the prior
    rate (1 + 0.6 * 4 = 3.4 tokens) verifies; at batch 8 even every
    sequence proposing 4 (8 * 3.4 = 27 tokens against 35 decode tokens'
    time) does not, at batch 4 (2.7) it does unless only one proposes; a
    request whose proposals keep failing stops verifying."""
    cost = VerifyCost((1, 8), (0.010, 0.020), (0.013, 0.088))
    assert cost.ratio(1) == pytest.approx(1.3)
    assert cost.ratio(8) == pytest.approx(4.4)
    assert cost.pays(["a"], [4])
    ids = [f"r{i}" for i in range(8)]
    assert not cost.pays(ids, [4] * 8)
    assert cost.pays(ids[:4], [4] * 4)
    assert not cost.pays(ids[:4], [4, 0, 0, 0])
    for _ in range(8):
        cost.verified("a", 4, 0)
    assert cost.rates["a"] < PRIOR / 10
    assert not cost.pays(["a"], [4])
    cost.forget(["a"])
    assert cost.pays(["a"], [4])


# ---- the verify step's inputs ---------------------------------------------
def test_verify_batch():
    """Two sequences of 63 and 3 tokens on blocks [4, 7] and [2]; the first
    proposes 2 tokens (positions 63, 64: across its block boundary), the
    second none; width 4; a padding row up to MIN_DECODE_BATCH is not
    needed.  Padding columns write into the spare block 9."""
    step = verify_batch([11, 21], [[12, 13], []], [63, 3], [[4, 7], [2]],
                        4, 64, 3, 0, 9)
    assert step.input_ids.tolist() == [[11, 12, 13, 0], [21, 0, 0, 0]]
    assert step.position_ids.tolist() == [[62, 63, 64, 0], [2, 0, 0, 0]]
    assert step.ctx_lens.tolist() == [[63, 64, 65, 1], [3, 1, 1, 1]]
    assert step.cache_slots[0, :3].tolist() == [4 * 64 + 62, 4 * 64 + 63,
                                                7 * 64 + 0]
    assert step.cache_slots[1, 0].item() == 2 * 64 + 2
    spare = [step.cache_slots[0, 3], *step.cache_slots[1, 1:]]
    assert all(9 * 64 <= s < 10 * 64 for s in spare)
    assert step.block_table.tolist() == [[4, 7, 9], [2, 9, 9]]


def test_verify_batch_refuses_positions_beyond_the_blocks():
    with pytest.raises(ValueError, match="position 64 lies beyond"):
        verify_batch([1], [[2, 3]], [63], [[4]], 4, 64, 3, 0, 9)
    with pytest.raises(ValueError, match="3 proposals do not fit"):
        verify_batch([1], [[2, 3, 4]], [3], [[4]], 3, 64, 3, 0, 9)


# ---- acceptance -------------------------------------------------------------
class _Model(torch.nn.Module):
    """vLLM's logits processor and the Spyre sampler over given logits."""

    def __init__(self) -> None:
        super().__init__()
        self.logits_processor = LogitsProcessor(VOCAB, logits_as_input=True)
        self.sampler = SpyreSampler()

    def compute_logits(self, logits, sampling_metadata):
        return self.logits_processor(None, logits, sampling_metadata)

    def sample(self, logits, sampling_metadata):
        return self.sampler(logits, sampling_metadata)


def _runner(k: int) -> SpyreSpecModelRunner:
    from vllm.config import DeviceConfig
    runner = object.__new__(SpyreSpecModelRunner)
    runner.k = k
    runner.backoff = spyre_ngram.Backoff()
    runner.cost = None
    runner.draft = None
    runner.generators = {}
    runner.model = _Model()
    runner.device_config = DeviceConfig("cpu")
    return runner


def _group(i: int, params: SamplingParams) -> SequenceGroupMetadata:
    return SequenceGroupMetadata(
        request_id=f"r{i}", is_prompt=False,
        seq_data={i: SequenceData.from_seqs([1, 2, 3], [4])},
        sampling_params=params, block_tables={i: [0]})


def _step(runner, logits, proposals, params):
    """One verify step's acceptance: ``logits`` ``[rows, k + 1, VOCAB]``."""
    metas = [_group(i, p) for i, p in enumerate(params)]
    lens = [4] * len(metas)
    sm = runner.sampling_metadata(metas, lens, [1] * len(metas), None)
    first = sample(runner.model, logits[:, 0], sm)
    model_input = SpyreSpecModelInput(prefill=None, decode=None,
                                      num_live=len(metas),
                                      proposals=tuple(map(tuple, proposals)),
                                      decode_metas=tuple(metas))
    return runner._accept(first, model_input, logits)


def _peaked(tokens: list[int]) -> torch.Tensor:
    """Logits whose argmax at position j is ``tokens[j]``."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_step_table():
    """Rows: every proposal right (k + 1 tokens), the first wrong (1),
    the third wrong (3), no proposals (1), two of four proposed (3)."""
    runner = _runner(k=4)
    targets = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5],
               [3, 0, 0, 0, 0], [5, 4, 3, 2, 1]]
    proposals = [[1, 2, 3, 4], [0, 2, 3, 4], [1, 2, 0, 4], [], [5, 4]]
    logits = torch.stack([_peaked(t) for t in targets])
    out = _step(runner, logits, proposals,
                [SamplingParams(temperature=0)] * 5)
    table = [([s.output_token for s in g.samples], g.proposed)
             for g in out.outputs]
    assert table == [([1, 2, 3, 4, 5], 4), ([1], 4), ([1, 2, 3], 4),
                     ([3], 0), ([5, 4, 3], 2)]
    # The row that accepted nothing pauses; the others propose on.
    assert [runner.backoff.proposes(f"r{i}") for i in range(5)] == \
        [True, False, True, True, True]


def test_sampled_rows_keep_the_target_distribution():
    """8,000 unseeded rows, each proposing token 1 then 2 at temperature
    1: the first emitted token follows the first position's distribution,
    and after a kept proposal the second follows the second position's
    (total variation distance under 0.03; one standard deviation of a
    frequency among the 4,000 rows that keep the first proposal is at
    most 0.008)."""
    torch.manual_seed(0)
    rows = 8000
    p0 = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.1, 0.1])
    p1 = torch.tensor([0.3, 0.1, 0.2, 0.1, 0.2, 0.1])
    p2 = torch.full((VOCAB, ), 1 / VOCAB)
    logits = torch.stack([p0.log(), p1.log(), p2.log()]).expand(
        rows, 3, VOCAB).contiguous()
    out = _step(_runner(k=2), logits, [[1, 2]] * rows,
                [SamplingParams(temperature=1.0)] * rows)
    tokens = [[s.output_token for s in g.samples] for g in out.outputs]
    first = torch.bincount(torch.tensor([t[0] for t in tokens]),
                           minlength=VOCAB) / rows
    kept = [t for t in tokens if t[0] == 1]
    second = torch.bincount(torch.tensor([t[1] for t in kept]),
                            minlength=VOCAB) / len(kept)
    assert 0.5 * (first - p0).abs().sum() < 0.03
    assert 0.5 * (second - p1).abs().sum() < 0.03
    # A row whose first token is not the proposal stops there; one whose
    # both proposals hold gets a third token.
    assert all(len(t) == 1 for t in tokens if t[0] != 1)
    assert all(len(t) == 3 for t in tokens if t[:2] == [1, 2])
