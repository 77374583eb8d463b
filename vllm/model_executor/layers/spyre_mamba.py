"""Mamba-2 layers of hybrid models (Bamba) over Spyre's state slots.

A Mamba-2 layer keeps, per sequence, two states instead of keys and
values: the last ``K - 1`` inputs of its causal convolution (``K`` the
kernel width) and the SSM state ``[heads, head_dim, state_size]``.
FMS 1.13.1's ``SSM`` keeps them in a Python object per batch
(``SSMCacheUnit``), reallocated per generate call, and picks its code path
from flags on it.  Here the states live in *slots* allocated once at
start-up (``StatePool``): static batching gives each row of a warm-up
shape its own slot, continuous batching each running sequence, and a step
reads and writes its rows' slots by index (``SSMStep``), so the tensors a
compiled graph sees have the same shapes at every step.

``SpyreSSM`` computes what FMS's and transformers' Mamba-2 layers compute,
from their parameters, with:

* padding positions (``SSMStep.valid``) giving the convolution zeros and
  leaving the state unchanged (their time step is 0), so a left-padded
  row equals the unpadded sequence even with a projection bias;
* a step's starting state read from its rows' slots (zero where
  ``SSMStep.fresh``: a sequence's first step), so a prompt prefilled in
  chunks carries its state from chunk to chunk;
* a prompt scanned in chunks of ``chunk_size`` positions (``ssd_scan``:
  within a chunk in matrix form, across chunks through the chunks' decays,
  with no loop over the chunks, so the length may be dynamic); a decode
  step (one position) the recurrence (``recurrent_step``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class SSMStep:
    """One step of one Mamba-2 layer: the layer's state pools and the
    step's rows.  FMS's model code hands it to the layer in place of a
    cache; FMS's block sets ``seqlen_offset`` and ``has_previous_state``
    on it after the layer, which nothing reads."""

    conv: torch.Tensor  # [slots, conv_dim, K - 1] float32
    ssm: torch.Tensor  # [slots, heads, head_dim, state_size] float32
    slots: torch.Tensor  # [B] int64: each row's slot
    fresh: torch.Tensor  # [B] bool: the row starts from zero states
    valid: torch.Tensor  # [B, L] bool: real positions (else padding)
    seqlen_offset: int = 0
    has_previous_state: bool = False


@dataclass(frozen=True)
class StateLayout:
    """Per-layer state geometry of the Mamba-2 layers of a loaded model."""

    layers: int
    conv_dim: int
    conv_history: int
    heads: int
    head_dim: int
    state_size: int

    @classmethod
    def of(cls, model: nn.Module) -> "StateLayout | None":
        """The geometry of ``model``'s Mamba-2 layers, None without any."""
        ssms = [m for m in model.modules() if isinstance(m, _fms_ssm())]
        if not ssms:
            return None
        first = ssms[0]
        return cls(layers=len(ssms), conv_dim=first.conv_dim,
                   conv_history=first.conv_kernel_size - 1,
                   heads=first.nheads, head_dim=first.head_dim,
                   state_size=first.ssm_state_size)

    @classmethod
    def from_config(cls, hf_config) -> "StateLayout | None":
        """The geometry a Hugging Face hybrid config states (Bamba's
        ``mamba_*`` fields; its attention layers by ``attn_layer_indices``,
        or Granite 4's ``layer_types``, where none means all Mamba-2), None
        for a model without Mamba-2 layers."""
        if getattr(hf_config, "mamba_d_state", None) is None:
            return None
        n = hf_config.num_hidden_layers
        types = getattr(hf_config, "layer_types", None)
        if types is None and hasattr(hf_config, "attn_layer_indices"):
            layers = n - len(set(hf_config.attn_layer_indices or ()))
        else:
            layers = sum(t == "mamba" for t in types or ["mamba"] * n)
        if layers == 0:
            return None
        inner = int(hf_config.mamba_expand * hf_config.hidden_size)
        state = hf_config.mamba_d_state
        return cls(layers=layers,
                   conv_dim=inner + 2 * hf_config.mamba_n_groups * state,
                   conv_history=hf_config.mamba_d_conv - 1,
                   heads=hf_config.mamba_n_heads,
                   head_dim=hf_config.mamba_d_head, state_size=state)

    def slot_bytes(self) -> int:
        """Bytes one slot takes over all layers, in float32 (whatever the
        model's dtype: a prompt prefilled in chunks must carry exactly what
        one pass would)."""
        conv = self.conv_dim * self.conv_history
        ssm = self.heads * self.head_dim * self.state_size
        return self.layers * (conv + ssm) * 4

    def allocate(self, slots: int) -> "StatePool":
        return StatePool(
            [torch.zeros(slots, self.conv_dim, self.conv_history,
                         dtype=torch.float32) for _ in range(self.layers)],
            [torch.zeros(slots, self.heads, self.head_dim, self.state_size,
                         dtype=torch.float32) for _ in range(self.layers)])


def cb_state_slots(max_num_seqs: int) -> int:
    """Slots of continuous batching's state pool: one per sequence the
    scheduler may run, and the spare one padding rows write to."""
    return max_num_seqs + 1


@dataclass
class StatePool:
    """Each Mamba-2 layer's states for ``slots`` sequences."""

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]

    @property
    def slots(self) -> int:
        return self.conv[0].shape[0]

    def steps(self, slots: torch.Tensor, fresh: torch.Tensor,
              valid: torch.Tensor) -> list[SSMStep]:
        """One ``SSMStep`` per layer for a step of these rows."""
        return [SSMStep(c, s, slots, fresh, valid)
                for c, s in zip(self.conv, self.ssm)]


@functools.cache
def _fms_ssm() -> type:
    from fms.modules.ssm import SSM
    return SSM


@functools.cache
def _layer_class() -> type:
    """The class loaded FMS Mamba-2 layers are given (FMS's, with
    ``SpyreSSM``'s forward)."""
    layer = type("SpyreSSMLayer", (SpyreSSM, _fms_ssm()), {})
    # Precompiled graphs pickle their guards, and pickle finds a class by
    # its module and name.
    globals()[layer.__name__] = layer
    return layer


def use_spyre_ssm(model: nn.Module) -> int:
    """Gives every FMS Mamba-2 layer of ``model`` ``SpyreSSM``'s forward
    (parameters unchanged); returns how many."""
    fms_ssm, layer = _fms_ssm(), _layer_class()
    count = 0
    for module in model.modules():
        if type(module) is fms_ssm:
            module.__class__ = layer
            count += 1
    return count


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., groups, n]`` -> ``[..., heads, n]``: each group serves
    ``heads / groups`` consecutive heads."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def recurrent_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor,
                   h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One position: ``x`` [b, h, d], ``dt`` [b, h], ``A`` [h], ``B``/``C``
    [b, h, n], ``h0`` [b, h, d, n].  Returns (y [b, h, d], new state)."""
    decay = torch.exp(dt * A)[..., None, None]
    h = h0 * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return torch.einsum("bhdn,bhn->bhd", h, C), h


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, h0: torch.Tensor,
             chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The state-space recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t
    B_t``, ``y_t = C_t . h_t`` over ``L`` positions from state ``h0``.

    ``x`` [b, L, h, d], ``dt`` [b, L, h], ``A`` [h], ``B``/``C`` [b, L, h,
    n], ``h0`` [b, h, d, n], all float32.  Returns (y [b, L, h, d], the
    state after the last position).  The positions are cut into chunks of
    ``chunk``: within a chunk the outputs are a masked product (each
    position against the earlier ones, weighted by the decay between
    them); each chunk's contribution to the state is summed in one
    product; the state at each chunk's start (from ``h0`` and the earlier
    chunks, through their total decays) is another.  Padding at the end
    has ``dt = 0``: no input and no decay."""
    b, L, h, d = x.shape
    pad = (-L) % chunk
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    n_chunks = (L + pad) // chunk
    x = x.reshape(b, n_chunks, chunk, h, d)
    B = B.reshape(b, n_chunks, chunk, h, -1)
    C = C.reshape(b, n_chunks, chunk, h, -1)
    dt = dt.reshape(b, n_chunks, chunk, h)
    # Cumulative log decay within each chunk: [b, c, q, h].
    s = torch.cumsum(dt * A, dim=2)
    causal = torch.ones(chunk, chunk, dtype=torch.bool,
                        device=x.device).tril()
    # decay[t, u] = exp(s_t - s_u) for u <= t: [b, c, t, u, h].
    gap = s[:, :, :, None, :] - s[:, :, None, :, :]
    decay = torch.exp(gap.masked_fill(~causal[:, :, None], float("-inf")))
    weights = torch.einsum("bcthn,bcuhn->bctuh", C, B) * decay * \
        dt[:, :, None, :, :]
    y = torch.einsum("bctuh,bcuhd->bcthd", weights, x)
    # Each chunk's own state from zero: [b, c, h, d, n].
    to_end = torch.exp(s[:, :, -1:, :] - s) * dt
    own = torch.einsum("bcuh,bcuhd,bcuhn->bchdn", to_end, x, B)
    # The state at the start of chunk k (k = 0 .. c): the decay from the
    # start of the sequence to it is exp(G_k), G_k the sum of the earlier
    # chunks' total log decays; chunk j's own state reaches it decayed by
    # exp(G_k - G_{j+1}), for j < k.
    G = F.pad(torch.cumsum(s[:, :, -1, :], dim=1), (0, 0, 1, 0))
    span = G[:, :, None, :] - G[:, None, 1:, :]  # [b, c + 1, c, h]
    earlier = torch.ones(n_chunks + 1, n_chunks, dtype=torch.bool,
                         device=x.device).tril(-1)
    carry = torch.exp(span.masked_fill(~earlier[:, :, None], float("-inf")))
    starts = torch.einsum("bkjh,bjhdn->bkhdn", carry, own) + \
        torch.exp(G)[..., None, None] * h0[:, None]
    # What each position reads of its chunk's starting state.
    y = y + torch.einsum("bcthn,bchdn->bcthd", C * torch.exp(s)[..., None],
                         starts[:, :n_chunks])
    return y.reshape(b, n_chunks * chunk, h, d)[:, :L], starts[:, -1]


def _after_padding(seq: torch.Tensor, history: int,
                   valid: torch.Tensor) -> torch.Tensor:
    """``seq`` ([b, channels, history + L]: a row's convolution history,
    then its L positions, the first ``pad`` of them padding, zeroed) with
    the history moved after the padding: ``[zeros(pad), history, real
    positions]``."""
    total = seq.shape[2]
    pad = valid.shape[1] - valid.sum(dim=1, keepdim=True)  # [b, 1]
    col = torch.arange(total, device=seq.device).unsqueeze(0)  # [1, T]
    source = torch.where(col < pad + history, col - pad, col)
    moved = seq.gather(2, source.clamp(min=0).unsqueeze(1).expand(
        -1, seq.shape[1], -1))
    return moved * (col >= pad).unsqueeze(1).to(seq.dtype)


class SpyreSSM(nn.Module):
    """The forward of a Mamba-2 layer over ``SSMStep`` states; mixed into
    FMS's ``SSM`` class by ``use_spyre_ssm`` (its parameters: ``in_proj``,
    ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``)."""

    def forward(self, input_states: torch.Tensor, mask=None,
                past_key_value_state: SSMStep = None, **kwargs):
        b, L, _ = input_states.shape
        step = past_key_value_state
        if step is None:  # a whole prompt, no cache: zero states, kept
            step = self._scratch(b, L, input_states.dtype)
        if not isinstance(step, SSMStep):
            raise TypeError("a Spyre Mamba-2 layer runs over the Spyre state "
                            f"slots (SSMStep), got {type(step).__name__}")
        valid = step.valid[..., None].to(input_states.dtype)  # [b, L, 1]
        gate, xBC, dt = self.in_proj(input_states * valid).split(
            [self.intermediate_size, self.conv_dim, self.nheads], dim=-1)
        keep = (~step.fresh).to(input_states.dtype)[:, None, None]
        history = step.conv[step.slots].to(xBC.dtype) * keep
        # The convolution over the previous K - 1 inputs and this step's,
        # the history moved past the row's left padding so that it
        # precedes the first real position.
        seq = _after_padding(
            torch.cat([history, (xBC * valid).transpose(1, 2)], dim=2),
            history.shape[2], step.valid)
        step.conv.index_copy_(0, step.slots,
                              seq[:, :, -history.shape[2]:].to(
                                  step.conv.dtype))
        xBC = F.conv1d(seq, self.conv1d.weight, self.conv1d.bias,
                       groups=self.conv_dim).transpose(1, 2)
        xBC = self.act(xBC) * valid
        x, B, C = xBC.split([self.intermediate_size,
                             self.n_groups * self.ssm_state_size,
                             self.n_groups * self.ssm_state_size], dim=-1)
        x = x.reshape(b, L, self.nheads, self.head_dim).float()
        B = _heads(B.reshape(b, L, self.n_groups, -1).float(), self.nheads)
        C = _heads(C.reshape(b, L, self.n_groups, -1).float(), self.nheads)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        dt = torch.clamp(dt, *self.time_step_limit) * valid.float()
        A = -torch.exp(self.A_log.float())
        h0 = step.ssm[step.slots] * keep.float()[..., None]
        if L == 1:
            y, h = recurrent_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0],
                                  h0)
            y = y[:, None]
        else:
            # The scan is exact for any chunk length: no longer than the
            # step, so a short step pays for no padding.
            y, h = ssd_scan(x, dt, A, B, C, h0, min(self.chunk_size, L))
        step.ssm.index_copy_(0, step.slots, h)
        y = y + x * self.D.float()[:, None]
        y = self.norm(y.reshape(b, L, -1), gate)
        return self.out_proj(y.to(input_states.dtype)), step

    def _scratch(self, b: int, L: int, dtype: torch.dtype) -> SSMStep:
        """Zero states of ``b`` rows of ``L`` real positions, thrown away
        after the pass (a prompt scored for its log-probabilities)."""
        return SSMStep(
            torch.zeros(b, self.conv_dim, self.conv_kernel_size - 1,
                        dtype=dtype),
            torch.zeros(b, self.nheads, self.head_dim, self.ssm_state_size),
            torch.arange(b), torch.ones(b, dtype=torch.bool),
            torch.ones(b, L, dtype=torch.bool))


# ---- a hybrid model's per-layer caches ------------------------------------
def layer_kinds(model: nn.Module) -> list[bool]:
    """Per decoder layer of an FMS model (``base_model.layers``): whether
    it is a Mamba-2 layer (else an attention layer)."""
    ssm = _fms_ssm()
    return [any(isinstance(m, ssm) for m in layer.modules())
            for layer in model.base_model.layers]


def layer_caches(is_ssm: list[bool], kv: list, steps: list[SSMStep]) -> list:
    """What FMS's hybrid model takes as ``past_key_value_states``: per
    layer in order, the attention layer's (keys, values) or the Mamba-2
    layer's ``SSMStep``."""
    kv_iter, step_iter = iter(kv), iter(steps)
    return [next(step_iter) if ssm else next(kv_iter) for ssm in is_ssm]


@dataclass(frozen=True)
class StateRows:
    """The Mamba-2 side of a continuous-batching step (B rows of L
    positions), built by the runner beside its ``PagedInputs``."""

    slots: torch.Tensor  # [B] int64: each row's state slot
    fresh: torch.Tensor  # [B] bool: the row starts a sequence
    valid: torch.Tensor  # [B, L] bool: real positions

    def row(self, i: int) -> "StateRows":
        return StateRows(self.slots[i:i + 1].clone(),
                         self.fresh[i:i + 1].clone(),
                         self.valid[i:i + 1].clone())

    @classmethod
    def prefill(cls, slot: int, rows: int, length: int, real: int,
                first: bool) -> "StateRows":
        """A prefill of ``real`` positions in ``rows`` rows of ``length``,
        left-padded, all in slot ``slot``; ``first``: it starts the
        sequence (its first row starts from zero states)."""
        pad = rows * length - real
        valid = (torch.arange(rows * length) >= pad).view(rows, length)
        fresh = torch.zeros(rows, dtype=torch.bool)
        fresh[0] = first
        return cls(torch.full((rows, ), slot, dtype=torch.long), fresh,
                   valid)

    @classmethod
    def decode(cls, slots: list[int], rows: int, spare: int) -> "StateRows":
        """One position per row: the sequences' slots, then padding rows
        on the spare slot."""
        padded = list(slots) + [spare] * (rows - len(slots))
        return cls(torch.tensor(padded, dtype=torch.long),
                   torch.zeros(rows, dtype=torch.bool),
                   torch.ones(rows, 1, dtype=torch.bool))
