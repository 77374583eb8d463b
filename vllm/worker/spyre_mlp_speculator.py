"""MLPSpeculatorProposer: IBM's MLP speculators for speculative decoding.

With ``--speculative-config '{"model": <speculator folder>,
"num_speculative_tokens": k}'`` where the folder holds an MLP speculator
(model type ``mlp_speculator``, arXiv 2404.19124; vLLM's
``MLPSpeculator`` class holds and loads its weights), each running
sequence's next ``k`` tokens are proposed from the served model's last
hidden state: the one whose logits gave the sequence's last token.  Stage
``i`` mixes the state carried so far with the embedding of the token
before it, normalises, and its head gives proposal ``i`` (greedy), which
is the next stage's token.

The served model's model code keeps each step's hidden states
(``ModelCode.keeps_hidden``); the runner hands this module the row of
each sequence that sampled (``keep``): a prefill's last position, a decode
row, or a verify row's position of its last emitted token.  A sequence
with no kept state yet proposes nothing.  The speculator runs in the
driver worker's process only, in float32, unsharded, also under tensor
parallelism: its parallel layers are built for one rank
(``spyre_one_rank``) and its embeddings read directly, so that no step of
it waits on the other ranks; the served model's last hidden states are
whole on every rank.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Sequence

import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.worker.spyre_one_rank import draft_vllm_config, one_rank
from vllm.worker.spyre_spec_cost import best_of

logger = init_logger(__name__)


class MLPSpeculatorProposer:
    """An MLP speculator and each running sequence's last hidden state."""

    def __init__(self, vllm_config: VllmConfig, *_) -> None:
        self.vllm_config = vllm_config
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.module = None
        #: Per request: the served model's hidden state whose logits gave
        #: its last token, ``[hidden]``.
        self.hidden: dict[str, torch.Tensor] = {}

    # ---- start-up -------------------------------------------------------
    def load(self) -> None:
        from vllm.model_executor.models.mlp_speculator import MLPSpeculator
        spec = self.vllm_config.speculative_config
        start = time.perf_counter()
        folder = spec.draft_model_config.model
        draft = draft_vllm_config(self.vllm_config)
        with set_current_vllm_config(draft), one_rank():
            self.module = MLPSpeculator(vllm_config=draft).eval()
        loaded = self.module.load_weights(_tensors(Path(folder)))
        missing = sorted(set(dict(self.module.named_parameters())) - loaded)
        if missing:
            raise ValueError(f"The MLP speculator {folder} lacks "
                             f"{', '.join(missing)}")
        logger.info("Spyre MLP speculator %s (%d stages) load took %.1f s",
                    folder, self.module.max_speculative_tokens,
                    time.perf_counter() - start)

    def block_bytes(self) -> int:
        return 0  # it keeps no cache

    def allocate_pool(self, num_blocks: int, pad_block: int) -> None:
        pass

    def warmup(self, max_num_seqs: int) -> None:
        pass  # not compiled

    def time_proposing(self, batch: int) -> float:
        """Seconds to propose ``k`` tokens for ``batch`` sequences."""
        ids = [f"warm-up {i}" for i in range(batch)]
        width = self.module.emb_dim

        def propose():
            for request_id in ids:
                self.keep(request_id, torch.zeros(width))
            self._propose(ids, [1] * batch, [self.k] * batch)
            self.forget(ids)

        return best_of(propose)

    # ---- per step -------------------------------------------------------
    def keep(self, request_id: str, hidden: torch.Tensor) -> None:
        self.hidden[request_id] = hidden.detach().float().clone()

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.hidden.pop(request_id, None)

    def stepped(self, model_input, outputs, hidden) -> None:
        """After a step: keeps the hidden state whose logits gave each
        sequence's last token (``hidden``: the step's prefill's and
        decode rows' kept ones)."""
        if outputs is None:
            return
        prefill_hidden, decode_hidden = hidden
        if model_input.prefill is not None and model_input.sample_prefill:
            self.keep(model_input.prefill_request, prefill_hidden[0])
        metas = model_input.decode_metas or ()
        offset = len(outputs) - len(metas)
        for row, (meta, group) in enumerate(zip(metas, outputs[offset:])):
            self.keep(meta.request_id,
                      decode_hidden[row] if model_input.verify is None else
                      decode_hidden[row, len(group.samples) - 1])

    def propose(self, metas: Sequence, seqs: Sequence,
                rooms: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Up to ``rooms[i]`` proposals for each running sequence (its
        group and its (id, data))."""
        return self._propose([m.request_id for m in metas],
                             [d.get_last_token_id() for _, d in seqs], rooms)

    @current_platform.inference_mode()
    def _propose(self, request_ids: Sequence[str],
                 last_tokens: Sequence[int],
                 rooms: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Greedy proposals; none for a sequence without a kept hidden
        state."""
        rows = [i for i, room in enumerate(rooms)
                if room > 0 and request_ids[i] in self.hidden]
        if not rows:
            return ()
        out: list[list[int]] = [[] for _ in rooms]
        m = self.module
        state = torch.stack([self.hidden[request_ids[i]] for i in rows])
        if m.scale_input:
            state = m.ln0(state) / math.sqrt(2)
        tokens = torch.tensor([last_tokens[i] for i in rows])
        mix = m.emb_weight / m.state_weight
        for stage in range(max(rooms[i] for i in rows)):
            embedded = torch.nn.functional.embedding(tokens,
                                                     m.emb[stage].weight)
            state = m.proj[stage](state) + mix * embedded
            state = m.activation(m.ln[stage](state))
            tokens = (state @ m.head[stage].weight.t()).argmax(-1)
            for row, i in enumerate(rows):
                if stage < rooms[i]:
                    out[i].append(int(tokens[row]))
        return tuple(tuple(p) for p in out)


def _tensors(folder: Path):
    """The speculator's tensors, from its safetensors or PyTorch files."""
    from safetensors import safe_open
    files = sorted(folder.glob("*.safetensors"))
    if files:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    for path in sorted(folder.glob("*.bin")):
        yield from torch.load(path, map_location="cpu",
                              weights_only=True).items()
