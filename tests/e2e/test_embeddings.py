"""Pooling models offline, end to end: ``LLM.embed`` and ``LLM.score`` on
the Spyre backend against transformers (and sentence-transformers for
all-MiniLM-L6-v2), packing of short texts, the step table of the pooling
scheduler, Matryoshka ``dimensions``, tensor parallelism over 3 ranks,
nothing compiled after warm-up, and clear refusals."""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from spyre_support.engines import compile_count, spyre_llm
from spyre_support.paths import MINILM_DIR
from vllm.attention.ops import spyre_encoder_attention as encoder_attention
from spyre_support.tiny_encoders import (build_tiny_encoder, hf_embeddings,
                                         hf_scores, random_texts)

#: Two shapes: eight rows of 64 slots (short texts several to a row) and
#: two rows of 256.
SHAPES = {"VLLM_SPYRE_WARMUP_PROMPT_LENS": "64,256",
          "VLLM_SPYRE_WARMUP_BATCH_SIZES": "8,2"}
#: (start, end) marker ids and the ids texts are drawn from.
MINILM_TOKENS = dict(frame=(101, 102), vocab=(1000, 30000))
TINY_TOKENS = dict(frame=(0, 2), vocab=(4, 380))
QUERY = "spyre card batch"
DOCUMENTS = ["the batch of tokens", "red green blue", "compile the graph",
             "spyre", "a fast kernel in the cache", "one two three",
             # Longer than ModernBERT's local-attention window.
             "spyre cards compile the graph of a batch " * 8]


def env(backend: str, **extra) -> dict:
    return {"VLLM_SPYRE_DYNAMO_BACKEND": backend, **SHAPES, **extra}


def cosines(vectors, reference) -> torch.Tensor:
    got = torch.tensor([o.outputs.embedding for o in vectors])
    return torch.nn.functional.cosine_similarity(got, reference, dim=1)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """Tiny checkpoints: name -> (folder, pooling of its reference)."""
    root = tmp_path_factory.mktemp("encoders")
    return {
        # No sentence-transformers config: BERT's default, CLS.
        "bert": (build_tiny_encoder("bert", root / "bert"), "cls"),
        "roberta": (build_tiny_encoder("roberta", root / "roberta",
                                       pooling="mean"), "mean"),
        "bert-matryoshka": (build_tiny_encoder(
            "bert", root / "bert-m", pooling="mean", matryoshka=True),
                            "mean"),
        "bert-cross": (build_tiny_encoder("bert-cross", root / "bc"), None),
        "roberta-cross": (build_tiny_encoder("roberta-cross", root / "rc"),
                          None),
        # No FMS encoder: the Hugging Face body.
        "modernbert-cross": (build_tiny_encoder("modernbert-cross",
                                                root / "mc"), None),
    }


def encoder_of(llm):
    """The driver's FMS encoder module."""
    return llm.llm_engine.model_executor.driver_worker.worker \
        .model_runner.model.encoder


def embed_checked(llm, model_dir, texts, pooling) -> None:
    """Embeds ``texts`` (token ids), none compiling, each within cosine
    0.9999 of the reference."""
    from vllm import TokensPrompt
    before = compile_count()
    out = llm.embed([TokensPrompt(prompt_token_ids=t) for t in texts],
                    use_tqdm=False)
    assert compile_count() == before
    sims = cosines(out, hf_embeddings(model_dir, texts, pooling))
    assert sims.min() >= 0.9999, sims


@pytest.mark.parametrize("backend", ["eager", "inductor", "torch-ops"])
@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_tiny_embeddings_match_transformers(encoders, name, backend):
    from vllm.spyre_kernels import ops as native
    path, pooling = encoders[name]
    texts = random_texts(50, 256, **TINY_TOKENS)
    settings = (env("eager", VLLM_SPYRE_NATIVE_KERNELS="0")
                if backend == "torch-ops" else env(backend))
    with spyre_llm(path, settings, task="embed") as llm:
        # Both CPU backends run attention on the C++ kernel; the torch-op
        # path on SDPA.
        kernel = backend != "torch-ops" and native.available()
        assert encoder_of(llm).attn_name == (
            encoder_attention.ATTN_NAME_CPU if kernel else
            encoder_attention.ATTN_NAME)
        embed_checked(llm, path, texts, pooling)


@pytest.mark.smollm2
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_minilm_matches_transformers_and_sentence_transformers(backend):
    from sentence_transformers import SentenceTransformer
    texts = random_texts(50, 256, **MINILM_TOKENS)
    sentences = ["The capital of France is Paris.", "a",
                 "Spyre cards fit IBM Z and Power machines. " * 20,
                 "How do plants make their food?"]
    with spyre_llm(MINILM_DIR, env(backend), task="embed") as llm:
        embed_checked(llm, MINILM_DIR, texts, "mean")
        out = llm.embed(sentences, use_tqdm=False)
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu").encode(
        sentences, convert_to_tensor=True)
    assert cosines(out, reference).min() >= 0.9999


@pytest.mark.smollm2
@pytest.mark.parametrize("name", ["minilm", "roberta"])
def test_bfloat16_matrix_products_stay_within_cosine_0_9999(encoders, name):
    """``--dtype bfloat16``: every matrix product in bfloat16, the rest in
    float32; embeddings still within cosine 0.9999 of float32
    transformers, nothing compiled after warm-up."""
    path, pooling = ((MINILM_DIR, "mean") if name == "minilm" else
                     encoders[name])
    tokens = MINILM_TOKENS if name == "minilm" else TINY_TOKENS
    texts = random_texts(50, 256, **tokens, seed=5)
    with spyre_llm(path, env("inductor"), task="embed",
                   dtype="bfloat16") as llm:
        model = llm.llm_engine.model_executor.driver_worker.worker \
            .model_runner.model
        assert model.bf16_matmuls
        assert model.encoder.attn_name == encoder_attention.ATTN_NAME_CPU_BF16
        embed_checked(llm, path, texts, pooling)


@pytest.mark.smollm2
@pytest.mark.parametrize("name", ["minilm", "roberta"])
def test_tensor_parallel_embeddings(encoders, name):
    """12 heads (all-MiniLM) and 6 (tiny RoBERTa) split over 3 ranks."""
    path, pooling = ((MINILM_DIR, "mean") if name == "minilm" else
                     encoders[name])
    tokens = MINILM_TOKENS if name == "minilm" else TINY_TOKENS
    texts = random_texts(20, 256, **tokens, seed=1)
    with spyre_llm(path, env("eager"), task="embed",
                   tensor_parallel_size=3) as llm:
        embed_checked(llm, path, texts, pooling)


@pytest.mark.parametrize("name, backend", [("bert-cross", "eager"),
                                           ("roberta-cross", "eager"),
                                           ("bert-cross", "inductor"),
                                           ("modernbert-cross", "eager"),
                                           ("modernbert-cross", "inductor")])
def test_scores_match_the_cross_encoder(encoders, name, backend):
    path, _ = encoders[name]
    reference = hf_scores(path, QUERY, DOCUMENTS)
    with spyre_llm(path, env(backend), task="score") as llm:
        before = compile_count()
        out = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        assert compile_count() == before
    scores = [o.outputs.score for o in out]
    assert scores == pytest.approx(reference, abs=1e-4)
    by_score = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    assert by_score == sorted(range(len(DOCUMENTS)),
                              key=lambda i: -reference[i])


def test_tensor_parallel_scores(encoders):
    path, _ = encoders["bert-cross"]
    with spyre_llm(path, env("eager"), task="score",
                   tensor_parallel_size=3) as llm:
        out = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert [o.outputs.score for o in out] == pytest.approx(
        hf_scores(path, QUERY, DOCUMENTS), abs=1e-4)


def test_matryoshka_dimensions_normalize_and_token_states(encoders):
    from vllm import PoolingParams, TokensPrompt
    path, pooling = encoders["bert-matryoshka"]
    texts = random_texts(6, 60, **TINY_TOKENS, seed=2)
    prompts = [TokensPrompt(prompt_token_ids=t) for t in texts]
    with spyre_llm(path, env("eager"), task="embed") as llm:
        short = llm.embed(prompts, pooling_params=PoolingParams(dimensions=16),
                          use_tqdm=False)
        raw = llm.embed(prompts, pooling_params=PoolingParams(normalize=False),
                        use_tqdm=False)
        several = [(p, t) for p, t in zip(prompts, texts) if len(t) > 1][:2]
        tokens = llm.encode([p for p, _ in several],
                            pooling_params=PoolingParams(softmax=False),
                            pooling_task="encode",
                            use_tqdm=False)
    # The "encode" task: every token's hidden state (vLLM's ALL pooling).
    from transformers import AutoModel
    body = AutoModel.from_pretrained(path).eval()
    for out, (_, ids) in zip(tokens, several):
        with torch.no_grad():
            hidden = body(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(out.outputs.data, hidden, rtol=1e-4,
                                   atol=1e-4)
    assert all(len(o.outputs.embedding) == 16 for o in short)
    assert cosines(short, hf_embeddings(path, texts, pooling,
                                        dimensions=16)).min() >= 0.9999
    norms = torch.tensor([o.outputs.embedding for o in raw]).norm(dim=1)
    assert (norms - 1).abs().min() > 1e-3  # not normalised


def test_step_table_packs_texts_into_one_shape(encoders):
    """Texts of these lengths, queued at once, run in the steps
    ``select_texts`` plans for two rows of 64 slots: first-fit in arrival
    order, a text that does not fit waiting for the next step."""
    from vllm import PoolingParams, TokensPrompt
    from spyre_support.engines import spyre_engine
    path, pooling = encoders["bert"]
    lengths = {"a": 50, "b": 40, "c": 30, "d": 10, "e": 64, "f": 5}
    gen = torch.Generator().manual_seed(4)
    texts = {rid: [0, *torch.randint(4, 380, (n - 2, ), generator=gen).tolist(),
                   2] for rid, n in lengths.items()}
    shapes = {"VLLM_SPYRE_DYNAMO_BACKEND": "eager",
              "VLLM_SPYRE_WARMUP_PROMPT_LENS": "64",
              "VLLM_SPYRE_WARMUP_BATCH_SIZES": "2"}
    steps, vectors = [], {}
    with spyre_engine(path, shapes, task="embed") as engine:
        for rid, ids in texts.items():
            engine.add_request(rid, TokensPrompt(prompt_token_ids=ids),
                               PoolingParams(task="embed"))
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.finished]
            steps.append(sorted(o.request_id for o in done))
            vectors.update({o.request_id: o.outputs.data for o in done})
    assert steps == [["a", "b", "d", "f"], ["c", "e"]]
    reference = hf_embeddings(path, list(texts.values()), pooling)
    got = torch.stack([vectors[rid] for rid in texts])
    sims = torch.nn.functional.cosine_similarity(got, reference, dim=1)
    assert sims.min() >= 0.9999


def test_refusals_name_the_values(encoders, tiny_llama):
    from vllm import SamplingParams, TokensPrompt
    path, pooling = encoders["bert"]
    texts = random_texts(3, 40, **TINY_TOKENS, seed=3)
    with spyre_llm(path, env("eager"), task="embed") as llm:
        with pytest.raises(ValueError, match="The input has 257 tokens, "
                           "more than the longest compiled Spyre warm-up "
                           r"shape holds \(256; prompt lengths: 64, 256\)"):
            llm.embed([TokensPrompt(prompt_token_ids=[5] * 257)],
                      use_tqdm=False)
        with pytest.raises(ValueError, match="generat"):
            llm.generate(["spyre"], SamplingParams(max_tokens=2),
                         use_tqdm=False)
        # Still serving, with the same results.
        embed_checked(llm, path, texts, pooling)
    gen_env = {"VLLM_SPYRE_DYNAMO_BACKEND": "eager",
               "VLLM_SPYRE_WARMUP_PROMPT_LENS": "64",
               "VLLM_SPYRE_WARMUP_NEW_TOKENS": "4",
               "VLLM_SPYRE_WARMUP_BATCH_SIZES": "1"}
    with spyre_llm(tiny_llama, gen_env) as llm:
        with pytest.raises(ValueError, match="pooling|embed"):
            llm.embed(["spyre card"], use_tqdm=False)


def test_hugging_face_body_refuses_tensor_parallel(encoders):
    """ModernBERT runs on the Hugging Face body, which is not sharded."""
    path, _ = encoders["modernbert-cross"]
    with pytest.raises(NotImplementedError,
                       match="--tensor-parallel-size 3 is not supported "
                       "for ModernBertForSequenceClassification"):
        with spyre_llm(path, env("eager"), task="score",
                       tensor_parallel_size=3):
            pass


def test_decoder_as_embedder_is_refused_at_start(tiny_llama):
    """A pooling model with no FMS encoder (here a decoder asked to embed)
    is refused at start-up, naming the encoders that are supported."""
    with pytest.raises(NotImplementedError, match="supported encoders: "
                       "BertModel"):
        with spyre_llm(tiny_llama, env("eager"), task="embed"):
            pass


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_models_of_one_class_in_one_process(encoders, backend, tmp_path):
    """A retrieval pipeline's embedder and cross-encoder, and a second
    embedder of the same architecture with other weights, all alive in one
    process on the same shapes: each runs its own weights (with frozen
    inductor graphs, dynamo would otherwise hand the second model the
    first one's graph)."""
    from vllm import LLM, TokensPrompt
    paths = [encoders["bert"][0],
             build_tiny_encoder("bert", tmp_path / "other", seed=1)]
    cross_path, _ = encoders["bert-cross"]
    texts = random_texts(8, 60, **TINY_TOKENS, seed=6)
    prompts = [TokensPrompt(prompt_token_ids=t) for t in texts]
    with spyre_llm(paths[0], env(backend), task="embed") as first:
        with mock.patch.dict(os.environ, env(backend)):
            second = LLM(model=str(paths[1]), task="embed")
            reranker = LLM(model=str(cross_path), task="score")
        vectors = [llm.embed(prompts, use_tqdm=False)
                   for llm in (first, second)]
        scores = [o.outputs.score for o in reranker.score(
            QUERY, DOCUMENTS, use_tqdm=False)]
        del second, reranker
    assert scores == pytest.approx(hf_scores(cross_path, QUERY, DOCUMENTS),
                                   abs=1e-4)
    for out, path in zip(vectors, paths):
        assert cosines(out, hf_embeddings(path, texts, "cls")).min() >= 0.9999


def test_classify_matches_the_sequence_classifier(encoders):
    """``LLM.classify``: the classifier's own activation (a sigmoid for one
    label) over transformers' logits of each text alone."""
    from transformers import (AutoModelForSequenceClassification,
                              AutoTokenizer)
    path, _ = encoders["roberta-cross"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = [torch.sigmoid(model(**tok(d, return_tensors="pt"))
                                  .logits[0]).tolist() for d in DOCUMENTS]
    with spyre_llm(path, env("eager"), task="classify") as llm:
        out = llm.classify(DOCUMENTS, use_tqdm=False)
    got = [o.outputs.probs for o in out]
    assert len(got) == len(DOCUMENTS)
    for g, e in zip(got, expected):
        assert g == pytest.approx(e, abs=1e-4)
