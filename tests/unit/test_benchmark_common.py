"""The arithmetic and workloads of the benchmarks (``spyre_support.bench``
and ``spyre_support.envs``,
the pure parts of benchmarks/serving_load.py) and roofline.py's read of
the memory bandwidth: what the printed tables are computed from; the
command line the benchmarks share, and that none writes a plot unasked."""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

import roofline  # benchmarks/ (pytest's pythonpath)
import serving_load
from spyre_support import bench, envs
from spyre_support.paths import REPO


def test_prompts_are_fixed_windows_of_exactly_p_tokens():
    ids = list(range(100))
    rows = bench.build_prompts(ids, batch=3, prompt_len=5, stride=13)
    assert rows == [[0, 1, 2, 3, 4], [13, 14, 15, 16, 17],
                    [26, 27, 28, 29, 30]]
    with pytest.raises(ValueError, match="need 105"):
        bench.build_prompts(ids, batch=8, prompt_len=14, stride=13)


def test_benchmark_text_holds_the_default_workload():
    words = bench.TEXT.read_text().split()
    # 16 rows of 64 tokens at stride 13 need 259 tokens; a word is at
    # least one token.
    assert len(words) >= (16 - 1) * bench.STRIDE + 64
    # The mixed serving workload's longest prompt: 512 tokens.
    assert len(words) >= 512


def test_mixed_requests_are_exact_windows_within_bounds():
    ids = list(range(1000, 1600))  # distinct: a window has one place
    reqs = bench.mixed_requests(ids, 300, (16, 40), (8, 12), seed=3)
    assert len(reqs) == 300
    for prompt, max_tokens in reqs:
        assert 16 <= len(prompt) <= 40
        assert 8 <= max_tokens <= 12
        start = prompt[0] - 1000
        assert prompt == ids[start:start + len(prompt)]
    # Inclusive ranges, both ends drawn.
    assert {len(p) for p, _ in reqs} >= {16, 40}
    assert {n for _, n in reqs} == set(range(8, 13))


def test_mixed_requests_are_deterministic():
    ids = list(range(600))
    a = bench.mixed_requests(ids, 50, (16, 512), (8, 128), seed=0)
    assert a == bench.mixed_requests(ids, 50, (16, 512), (8, 128), seed=0)
    assert a != bench.mixed_requests(ids, 50, (16, 512), (8, 128), seed=1)
    # The first requests do not depend on how many are drawn.
    assert a[:10] == bench.mixed_requests(ids, 10, (16, 512), (8, 128))
    with pytest.raises(ValueError, match="<= 600"):
        bench.mixed_requests(ids, 1, (16, 601), (8, 128))
    with pytest.raises(ValueError, match="max_tokens 9..8"):
        bench.mixed_requests(ids, 1, (16, 32), (9, 8))


def test_cb_max_model_len_is_whole_blocks():
    assert envs.cb_max_model_len(64, 64) == 128
    assert envs.cb_max_model_len(61, 4) == 128
    assert envs.cb_max_model_len(512, 128) == 640
    assert envs.cb_max_model_len(16, 4) == 64


def test_summary_medians_and_rates():
    t = bench.Timings(batch=4, new_tokens=11)
    for ttft, total in [(0.5, 2.5), (0.4, 2.4), (0.9, 4.9)]:
        t.runs.append(dict(ttft=ttft, total=total, compiles=0))
    s = t.summary()
    # decode: 4 rows * 10 tokens in (total - ttft) = 2.0, 2.0, 4.0 s
    assert s["decode_tok_s"] == pytest.approx(20.0)
    assert s["step_s"] == pytest.approx(0.2)
    assert s["ttft_s"] == pytest.approx(0.5)
    assert s["total_s"] == pytest.approx(2.5)
    assert s["tok_s"] == pytest.approx(44 / 2.5)
    assert s["compiles"] == 0
    t.runs.append(dict(ttft=0.5, total=2.5, compiles=2))
    assert t.summary()["compiles"] == 2


def test_leading_matches_and_table():
    assert bench.leading_matches([1, 2, 3], [1, 2, 4]) == 2
    assert bench.leading_matches([1, 2], [1, 2]) == 2
    assert bench.leading_matches([5], [1]) == 0
    text = bench.table(["engine", "B"], [["hf", 1], ["spyre", 16]])
    assert text.splitlines() == ["engine   B", "------  --",
                                 "hf       1", "spyre   16"]


def test_spyre_env_one_shape_per_batch_size():
    env = envs.warmup_env("inductor", [(16, 4, 1), (64, 4, 8)])
    assert env == {
        "VLLM_SPYRE_DYNAMO_BACKEND": "inductor",
        "VLLM_SPYRE_NATIVE_KERNELS": "1",
        "VLLM_SPYRE_WARMUP_PROMPT_LENS": "64,64",
        "VLLM_SPYRE_WARMUP_NEW_TOKENS": "4,4",
        "VLLM_SPYRE_WARMUP_BATCH_SIZES": "1,8",
    }


def test_the_torch_op_engines_turn_the_kernels_off():
    """``eager-torch-ops`` is eager on PyTorch's own ops, for comparison
    with the C++ kernels; every other label keeps them on."""
    assert envs.backend_env(envs.TORCH_OPS) == {
        "VLLM_SPYRE_DYNAMO_BACKEND": "eager",
        "VLLM_SPYRE_NATIVE_KERNELS": "0"}
    assert envs.cb_env(envs.TORCH_OPS) == {
        "VLLM_SPYRE_DYNAMO_BACKEND": "eager",
        "VLLM_SPYRE_NATIVE_KERNELS": "0", "VLLM_SPYRE_USE_CB": "1"}
    assert envs.backend_env("eager")["VLLM_SPYRE_NATIVE_KERNELS"] == "1"


def test_static_shapes_and_requests_they_hold():
    shapes = serving_load.parse_shapes("256:128:8,512:128:4")
    assert shapes == [(256, 128, 8), (512, 128, 4)]
    with pytest.raises(ValueError, match="prompt_len:new_tokens"):
        serving_load.parse_shapes("256:128")
    args = SimpleNamespace(static_shapes="256:128:8,512:128:4",
                           max_model_len=640)
    sizes = [(512, 128), (513, 8), (16, 129), (300, 100), (600, 50)]
    assert serving_load.misfits("static", args, sizes) == [
        (513, 8), (16, 129), (600, 50)]
    assert serving_load.misfits("cb", args, sizes) == [(600, 50)]
    # Word prompts (length unknown): only max_tokens is checked.
    assert serving_load.misfits("static", args, [(None, 128)]) == []
    assert serving_load.misfits("static", args, [(None, 129)]) == [
        (None, 129)]


@pytest.mark.parametrize("source, fmt, values, key, seconds", [
    ("vllm/worker/spyre_runner_base.py", "Spyre model load took %.1f s",
     (3.25, ), "load_s", 3.25),
    ("vllm/worker/spyre_runner_base.py",
     "Spyre warm-up of %d shape(s) took %.1f s", (2, 61.04), "warmup_s",
     61.04),
    ("vllm/worker/spyre_cb_model_runner.py",
     "Spyre continuous-batching warm-up took %.1f s (%s)",
     (61.04, "cached"), "warmup_s", 61.04),
])
def test_server_startup_times_are_read_from_the_runners_log_lines(
        source, fmt, values, key, seconds):
    """serving_load reads warm-up seconds from the server log: the lines
    the model runners write, with their current wording."""
    assert f'"{fmt}"' in (REPO / source).read_text()
    line = "INFO 11-23 21:40:20 [x.py:1] " + fmt % values
    assert serving_load.startup_from_log(line)[key] == float(
        "%.1f" % seconds)


def test_cb_static_ratios():
    def mode(tok_s, ttft, itl):
        return dict(result=dict(tok_per_s=tok_s, ttft_p50_ms=ttft,
                                itl_p50_ms=itl))
    r = serving_load.ratios({"cb": mode(30.0, 100.0, 50.0),
                             "static": mode(20.0, 400.0, 40.0)})
    assert r.keys() == {"cb"}
    assert r["cb"] == pytest.approx(dict(output_tok_s=1.5, ttft_p50=0.25,
                                         itl_p50=1.25))
    assert serving_load.ratios({"cb": mode(1.0, 1.0, 1.0)}) == {}
    # One CB server per --max-num-seqs value, each against static.
    r = serving_load.ratios({"cb-16": mode(30.0, 100.0, 50.0),
                             "cb-8": mode(25.0, 200.0, 40.0),
                             "static": mode(20.0, 400.0, 40.0)})
    assert r.keys() == {"cb-16", "cb-8"}
    assert r["cb-8"] == pytest.approx(dict(output_tok_s=1.25, ttft_p50=0.5,
                                           itl_p50=1.0))


def test_one_cb_server_per_max_num_seqs():
    args = SimpleNamespace(modes=["cb", "static"], max_num_seqs=[16],
                           backend="inductor", max_model_len=640,
                           serve_args="", static_shapes="64:16:8")
    assert serving_load.runs(args) == [("cb", "cb", 16),
                                       ("static", "static", None)]
    args.max_num_seqs = [16, 8]
    assert serving_load.runs(args) == [("cb-16", "cb", 16), ("cb-8", "cb", 8),
                                       ("static", "static", None)]
    env, cli, what = serving_load.server_setup("cb", args, 8)
    assert env["VLLM_SPYRE_USE_CB"] == "1"
    assert cli == ("--max-num-seqs", "8", "--max-model-len", "640")
    assert serving_load.server_setup("cb", args)[1][1] == "16"
    # --serve-args reach every server started.
    args.serve_args = "--dtype bfloat16 --enable-prefix-caching"
    for mode in ("cb", "static"):
        cli = serving_load.server_setup(mode, args)[1]
        assert cli[-3:] == ("--dtype", "bfloat16", "--enable-prefix-caching")


def test_offline_ratios_compare_equal_precisions():
    import offline
    engines = ["spyre-inductor", "spyre-inductor-bf16", "llamacpp-f32",
               "llamacpp-bf16", "llamacpp-q4_1", "hf"]
    # q4_1 has no engine of ours at its precision: no ratio column.
    assert offline.ratio_peers(engines) == ["llamacpp-f32", "llamacpp-bf16",
                                            "hf"]
    summaries = {(e, 1): dict(decode_tok_s=10.0 * (i + 1), ttft_s=1.0)
                 for i, e in enumerate(engines)}
    assert offline.ratios(engines, summaries, 1, "spyre-inductor-bf16") == {
        "decode/llamacpp-bf16": 20.0 / 40.0, "ttft/llamacpp-bf16": 1.0}
    assert set(offline.ratios(engines, summaries, 1, "spyre-inductor")) == {
        "decode/llamacpp-f32", "ttft/llamacpp-f32", "decode/hf", "ttft/hf"}
    assert offline.is_cb("spyre-cb-inductor-bf16")
    assert not offline.is_cb("spyre-inductor-bf16")


def test_stream_read_sums_every_element_once():
    """The roofline's bandwidth is timed on stream_read.cpp's sum: it reads
    each element once with any number of threads, whatever the length and
    alignment (x[1:] starts 4 bytes past a vector boundary)."""
    import torch
    stream_sum = roofline.stream_read()
    if stream_sum is None:
        pytest.skip("stream_read.cpp could not be built (no C++ compiler)")
    n = 2**18 + 7
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    for threads in (1, 2, 3):
        assert stream_sum(torch.ones(n), threads) == n
        for part in (x, x[1:], x[:5], x[:0]):
            tol = 1e-6 * part.abs().sum().item() + 1e-6
            assert stream_sum(part, threads) == pytest.approx(
                part.double().sum().item(), abs=tol)
    with pytest.raises(ValueError, match="not torch.float64"):
        stream_sum(x.double(), 1)
    with pytest.raises(ValueError, match="contiguous: False"):
        stream_sum(x[::2], 1)
    with pytest.raises(ValueError, match="threads >= 1"):
        stream_sum(x, 0)


def test_read_bandwidth_is_stream_reads_or_else_torch_sums(monkeypatch):
    rates = roofline.read_bandwidths(1 / 64, repeats=2)
    built = roofline.stream_read() is not None
    assert set(rates) == ({"stream_read", "torch.sum"} if built else
                          {"torch.sum"})
    assert all(0 < rate < float("inf") for rate in rates.values())
    assert roofline.read_bandwidth(1 / 64, repeats=1) > 0
    monkeypatch.setattr(roofline, "stream_read", lambda: None)
    assert set(roofline.read_bandwidths(1 / 64, repeats=1)) == {"torch.sum"}


def test_benchmark_parser_shared_options_and_defaults():
    ap = bench.benchmark_parser("What it measures.\n\nThe details.")
    assert ap.description == "What it measures."
    assert vars(ap.parse_args([])) == {"model": bench.DEFAULT_MODEL}
    with pytest.raises(SystemExit):
        ap.parse_args(["--backend", "eager"])  # only with backend=True

    ap = bench.benchmark_parser("Doc.", model="/m/a", backend=True)
    bench.add_shape_options(ap)
    ap.add_argument("--batch", type=int, default=8)
    bench.add_json_option(ap, "x.json")
    assert vars(ap.parse_args([])) == dict(
        model="/m/a", backend="inductor", prompt_len=64, new_tokens=64,
        batch=8, json=str(bench.RESULTS / "x.json"))
    assert vars(ap.parse_args([
        "--model", "/m/b", "--backend", "eager", "--prompt-len", "16",
        "--new-tokens", "4", "--json", "/tmp/r.json"])) == dict(
        model="/m/b", backend="eager", prompt_len=16, new_tokens=4, batch=8,
        json="/tmp/r.json")
    for bad in (["--backend", "sendnn"], ["--prompt-len", "sixty"]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
    # The options are listed in the order they were added.
    usage = ap.format_usage()
    flags = ["--model", "--backend", "--prompt-len", "--new-tokens",
             "--batch", "--json"]
    assert [usage.index(f + " ") for f in flags] == sorted(
        usage.index(f + " ") for f in flags)


def _fake_kernels(monkeypatch, built: bool) -> None:
    """Makes the kernel module's ``available()`` answer ``built``."""
    package = types.ModuleType("vllm.spyre_kernels")
    package.ops = SimpleNamespace(available=lambda: built)
    monkeypatch.setitem(sys.modules, package.__name__, package)


@pytest.mark.parametrize("built", [True, False])
def test_native_kernels_available_says_why_not(monkeypatch, capsys, built):
    _fake_kernels(monkeypatch, built)
    assert bench.native_kernels_available() is built
    out = capsys.readouterr().out
    assert out == ("" if built else
                   "the C++ kernels could not be built; nothing to compare\n")


@pytest.mark.parametrize("name", ["attention", "encoder_attention"])
def test_kernel_benchmarks_stop_without_the_kernels(monkeypatch, capsys,
                                                    name):
    """Without the C++ kernels a kernel benchmark exits 1 before it builds
    any case or writes any result."""
    import importlib
    module = importlib.import_module(name)
    _fake_kernels(monkeypatch, False)
    monkeypatch.setattr(module, "write_json", pytest.fail)
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])
    assert module.main() == 1
    assert "nothing to compare" in capsys.readouterr().out


def _docs_defaults(args) -> list[str]:
    """The parsed values that are paths under docs/."""
    docs = str(REPO / "docs")
    return [v for v in vars(args).values()
            if isinstance(v, str) and v.startswith(docs)]


def test_offline_writes_no_plot_unless_asked():
    import offline
    args = offline.build_parser().parse_args([])
    assert args.plot is None
    assert _docs_defaults(args) == []
    assert args.json == str(bench.RESULTS / "offline.json")
    png = "docs/images/offline-throughput.png"
    assert offline.build_parser().parse_args(["--plot", png]).plot == png


def test_serving_load_writes_no_plot_unless_asked():
    for workload in ("default", "mixed"):
        args = serving_load.parse_args(["--workload", workload])
        assert args.plot is None
        assert _docs_defaults(args) == []
    assert args.json == str(bench.RESULTS / "serving-cb-vs-static.json")
    png = "docs/images/continuous-batching.png"
    assert serving_load.parse_args(["--workload", "mixed", "--plot",
                                    png]).plot == png
