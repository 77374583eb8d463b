"""The up-front memory estimate (``spyre_memory``) without an engine: the
checkpoint count, the cache and activation sizes against the caches the
model really allocates, the cgroup limit, and the refusal message."""
import sys

import pytest
import torch

from vllm.attention.ops.spyre_kv_layout import CacheLayout
from vllm.config.spyre import WarmupShape
from vllm.worker import spyre_heap
from vllm.worker import spyre_memory as sm

GEOMETRY = sm.Geometry(layers=3, kv_heads=2, heads=4, head_size=16,
                       hidden=64, intermediate=96, vocab=500, item=4)


def test_read_checkpoint_counts_headers(tmp_path):
    from safetensors.torch import save_file
    save_file({"model.embed_tokens.weight": torch.zeros(50, 8),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8,
                                                                dtype=torch.
                                                                bfloat16)},
              str(tmp_path / "model-1.safetensors"))
    save_file({"lm_head.weight": torch.zeros(50, 8)},
              str(tmp_path / "model-2.safetensors"))
    counts = sm.read_checkpoint(str(tmp_path))
    assert counts == sm.Checkpoint(numel=50 * 8 + 16 * 8 + 50 * 8,
                                   whole_numel=50 * 8,
                                   matrix_numel=16 * 8 + 50 * 8,
                                   matrix_whole_numel=0)
    # The embedding stays whole on every rank; the rest is split.
    assert counts.rank_bytes(2, 1) == counts.numel * 2
    assert counts.rank_bytes(4, 2) == (400 + (128 + 400) // 2) * 4
    # The linear layers' weights (not the embedding) held in two bytes.
    assert counts.rank_bytes(4, 1, 2) == 400 * 4 + 528 * 2
    assert counts.rank_bytes(4, 2, 2) == 400 * 4 + 528 // 2 * 2
    assert sm.read_checkpoint(str(tmp_path / "none")) is None


def test_tensors_kept_whole_under_tensor_parallelism(tmp_path):
    """Under tensor parallelism a hybrid's Mamba-2 layers (and Granite 4's
    router, and GPT-OSS's experts and router) run whole on every rank;
    other experts are split, Granite 4's as Mixtral's."""
    from safetensors.torch import save_file
    whole = ["model.layers.0.mamba.in_proj.weight",
             "model.layers.0.block_sparse_moe.router.layer.weight",
             "model.layers.0.mlp.experts.gate_up_proj",
             "model.layers.0.mlp.router.bias"]
    split = ["model.layers.1.self_attn.q_proj.weight",
             "model.layers.0.shared_mlp.input_linear.weight",
             "model.layers.0.block_sparse_moe.input_linear.weight",
             "model.layers.0.block_sparse_moe.output_linear.weight",
             "model.layers.0.block_sparse_moe.experts.0.w1.weight"]
    save_file({n: torch.zeros(4, 8) for n in whole + split},
              str(tmp_path / "model.safetensors"))
    counts = sm.read_checkpoint(str(tmp_path))
    assert counts == sm.Checkpoint(numel=9 * 32, whole_numel=4 * 32,
                                   matrix_numel=7 * 32,
                                   matrix_whole_numel=2 * 32)


def test_kv_bytes_equal_the_allocated_caches():
    layout = CacheLayout(layers=3, kv_heads=2, k_head_dim=16, v_head_dim=16)
    for batch, length in [(1, 64), (4, 88), (8, 1088)]:
        caches = layout.allocate(batch, length, torch.float32)
        allocated = sum(k.nbytes + v.nbytes for k, v in caches)
        assert GEOMETRY.kv_bytes(batch, length) == allocated


def test_static_estimate_sums_caches_and_takes_the_largest_step():
    shapes = [WarmupShape(64, 24, 4), WarmupShape(256, 64, 2),
              WarmupShape(128, 8, 2)]
    est = sm.static_estimate(100, 1000, GEOMETRY, shapes, "eager")
    assert est.kv_cache == (GEOMETRY.kv_bytes(4, 88) +
                            GEOMETRY.kv_bytes(2, 320) +
                            GEOMETRY.kv_bytes(2, 136))
    # 2 x 256 prompt tokens over 320 positions is the largest prefill.
    assert est.activations == GEOMETRY.activation_bytes(2, 256, 320)
    assert "prompt_len=256, new_tokens=64, batch_size=2" in est.sized_for
    assert est.overhead == sm.GiB // 10 + int(1000 * 0.04)
    assert est.overhead == sm.overhead_bytes(1000, "eager")
    assert est.total == 100 + 1000 + est.kv_cache + est.activations + \
        est.overhead


def test_quantized_codes_count_as_stored(tmp_path):
    """A quantized checkpoint's codes are held as stored, its floating
    tensors at the model's dtype."""
    from safetensors.torch import save_file
    save_file({"model.embed_tokens.weight": torch.zeros(50, 8,
                                                        dtype=torch.float16),
               "model.layers.0.mlp.up_proj.qweight": torch.zeros(
                   2, 16, dtype=torch.int32),
               "model.layers.0.mlp.up_proj.scales": torch.zeros(
                   1, 16, dtype=torch.float16),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(
                   8, 16, dtype=torch.float8_e4m3fn)},
              str(tmp_path / "model.safetensors"))
    counts = sm.read_checkpoint(str(tmp_path))
    assert counts == sm.Checkpoint(numel=400 + 16, whole_numel=400,
                                   matrix_numel=0, matrix_whole_numel=0,
                                   code_bytes=2 * 16 * 4 + 8 * 16,
                                   code_whole_bytes=0)
    assert counts.rank_bytes(4, 1, 2) == (400 + 16) * 4 + 256
    assert counts.rank_bytes(4, 2) == (400 + 8) * 4 + 128
    assert counts.rank_matrices(1) == 0


def test_cb_estimate_sizes_the_pool_asked_for():
    est = sm.cb_estimate(0, 0, GEOMETRY, blocks=5, block_size=64,
                         max_model_len=300, max_num_seqs=16,
                         backend="inductor", override=False, on_kernel=True)
    assert est.kv_cache == GEOMETRY.kv_bytes(5, 64)
    # A whole 300-token prefill; the kernel holds no [heads, L, L] scores;
    # a request asking for prompt log-probabilities adds its own pass.
    assert est.activations == max(
        GEOMETRY.activation_bytes(1, 300, 300, scores=False),
        GEOMETRY.activation_bytes(16, 1, 300),
        GEOMETRY.prompt_logprobs_bytes(300))
    assert "5 blocks of one sequence of max_model_len=300" in est.sized_for
    est = sm.cb_estimate(0, 0, GEOMETRY, 40, 64, 300, 16, "eager", True,
                         True)
    assert "--num-gpu-blocks-override 40" in est.sized_for
    # The kernel on eager prefills whole sequences too.
    assert est.activations == max(
        GEOMETRY.activation_bytes(1, 300, 300, scores=False),
        GEOMETRY.prompt_logprobs_bytes(300))
    # The torch ops and the card prefill a block at a time, with its
    # scores.
    for backend in ("eager", "inductor", "sendnn"):
        est = sm.cb_estimate(0, 0, GEOMETRY, 5, 64, 300, 1, backend, False,
                             False)
        assert est.activations == max(
            GEOMETRY.activation_bytes(1, 64, 300),
            GEOMETRY.prompt_logprobs_bytes(300))


def test_attention_sinks_count_their_scores():
    """With attention sinks the attention holds three copies of its
    scores, also in a whole prompt's pass (PyTorch's own causal attention
    holds none without them)."""
    sinks = sm.Geometry(**{**GEOMETRY.__dict__, "score_copies": 3})
    scores = GEOMETRY.heads * 64 * 300 * GEOMETRY.item
    assert (sinks.activation_bytes(1, 64, 300)
            - GEOMETRY.activation_bytes(1, 64, 300)) == 2 * scores
    whole = GEOMETRY.heads * 300 * 300 * GEOMETRY.item
    assert (sinks.prompt_logprobs_bytes(300)
            - GEOMETRY.prompt_logprobs_bytes(300)) == 3 * whole


def test_prompt_logprobs_pass_grows_with_the_prompt_not_its_logits():
    """The pass's logits are held one slice at a time: a prompt ten times
    longer adds only its activations."""
    from vllm.worker.spyre_prompt_logprobs import SLICE
    short, long = (GEOMETRY.prompt_logprobs_bytes(n) for n in (300, 3000))
    logits = SLICE * GEOMETRY.vocab * 9
    assert short - GEOMETRY.activation_bytes(1, 300, 300,
                                             scores=False) == logits
    assert long - GEOMETRY.activation_bytes(1, 3000, 3000,
                                            scores=False) == logits


@pytest.mark.parametrize("files, expected", [
    ({"memory.max": "max\n"}, None),
    ({"memory.max": f"{2**30}\n"}, 2**30),
    ({"memory/memory.limit_in_bytes": f"{3 * 2**30}\n"}, 3 * 2**30),
    ({}, None),
])
def test_memory_limit_reads_the_cgroup(tmp_path, files, expected):
    import psutil
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    total = psutil.virtual_memory().total
    assert sm.memory_limit(str(tmp_path)) == min(total, expected or total)


def test_check_names_the_parts_and_what_is_available():
    est = sm.Estimate(process=2**30, weights=2**30, kv_cache=2**29,
                      activations=0, overhead=0, sized_for="the shape X")
    sm.check(est, limit=8 * 2**30, utilization=0.5, ranks_here=1)
    with pytest.raises(ValueError) as err:
        sm.check(est, limit=8 * 2**30, utilization=0.5, ranks_here=3)
    message = str(err.value)
    assert "sized for the shape X" in message
    assert "a rank needs about 2.50 GiB (process 1.00, weights 1.00, " \
        "key/value caches 0.50" in message
    assert "but 1.33 GiB are available to each of 3 ranks " \
        "(--gpu-memory-utilization 0.5 of 8.00 GiB)" in message


_FAULTS = """
import resource, sys, torch
from vllm.worker import spyre_heap as spyre_memory
if sys.argv[1] == "keep":
    assert spyre_memory.keep_large_buffers(True)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(5):  # a pass: three large activations, freed at its end
    before = faults()
    x = torch.ones(48 << 18)
    y = torch.ones(40 << 18)
    z = x + 1
    del x, y, z
    counts.append(faults() - before)
print(counts[-1])
"""

#: Pages of one pass's buffers (48 + 40 + 48 MiB).
_PASS_PAGES = (136 << 20) // 4096


def _page_faults_of_a_repeated_pass(mode: str) -> int:
    import subprocess
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_large_buffers_are_reused_instead_of_faulted_in_again():
    """Past glibc's default mmap threshold every buffer of a pass is
    mapped and faulted in anew each pass; kept in the heap, most of the
    fifth pass's buffers reuse the memory of earlier passes (glibc's
    aligned allocation still grows the heap for one of them)."""
    assert _page_faults_of_a_repeated_pass("default") > 0.9 * _PASS_PAGES
    assert _page_faults_of_a_repeated_pass("keep") < 0.5 * _PASS_PAGES


def test_large_buffers_left_alone_when_the_user_tuned_malloc():
    assert spyre_heap.keep_large_buffers(False) is False


def test_hybrid_geometry_counts_attention_layers_only():
    """Bamba's 3 Mamba-2 layers hold states, its attention layer keys and
    values."""
    from types import SimpleNamespace

    from transformers import BambaConfig
    text = BambaConfig(hidden_size=96, num_hidden_layers=4,
                       attn_layer_indices=[1], num_attention_heads=6,
                       num_key_value_heads=3, mamba_n_heads=8,
                       mamba_d_head=24, mamba_expand=2, mamba_d_state=16,
                       mamba_n_groups=2, mamba_d_conv=4, intermediate_size=192)
    model = SimpleNamespace(
        hf_text_config=text, get_num_layers=lambda p: 4,
        get_num_kv_heads=lambda p: 3, get_num_attention_heads=lambda p: 6,
        get_head_size=lambda: 16, get_hidden_size=lambda: 96,
        get_vocab_size=lambda: 384)
    vllm_config = SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=1))
    geometry = sm.geometry_of(vllm_config, 4)
    assert geometry.layers == 1
    assert geometry.state_slot_bytes == 3 * (256 * 3 + 8 * 24 * 16) * 4


def test_hybrid_state_slots_are_counted():
    """A hybrid model's Mamba-2 states: a slot per row of each batch size
    under static batching, a slot per sequence and a spare under
    continuous batching; the geometry reads them off the config."""
    import dataclasses
    hybrid = dataclasses.replace(GEOMETRY, state_slot_bytes=1000)
    shapes = [WarmupShape(64, 24, 4), WarmupShape(128, 8, 4),
              WarmupShape(64, 8, 2)]
    plain = sm.static_estimate(0, 0, GEOMETRY, shapes, "eager")
    assert sm.static_estimate(0, 0, hybrid, shapes, "eager").kv_cache == \
        plain.kv_cache + 1000 * (4 + 2)
    plain = sm.cb_estimate(0, 0, GEOMETRY, 5, 64, 300, 16, "eager", False,
                           True)
    assert sm.cb_estimate(0, 0, hybrid, 5, 64, 300, 16, "eager", False,
                          True).kv_cache == plain.kv_cache + 1000 * 17


def test_lora_adapters_count_at_their_own_dtype():
    """bfloat16 adapters of a model whose other tensors the CPU holds in
    float32 take two bytes an element; no LoRA, no bytes."""
    from types import SimpleNamespace

    def config(dtype):
        return SimpleNamespace(max_loras=2, max_cpu_loras=3, max_lora_rank=8,
                               lora_extra_vocab_size=16, lora_dtype=dtype)

    from vllm.worker import spyre_lora_memory as lm
    fixed = (lm.LORA_OVERHEAD +
             2 * 16 * GEOMETRY.hidden * GEOMETRY.item)  # embedding, head
    slots = 5 * lm.lora_slot_elements(GEOMETRY, 8, 16)
    assert lm.lora_bytes(GEOMETRY, None) == 0
    assert lm.lora_bytes(GEOMETRY, config(torch.float32)) == \
        fixed + 4 * slots
    assert lm.lora_bytes(GEOMETRY, config(torch.bfloat16)) == \
        fixed + 2 * slots
