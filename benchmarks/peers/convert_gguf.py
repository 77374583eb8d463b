"""llama.cpp's convert_hf_to_gguf.py, with one correction for byte-level
BPE tokenizers on Llama-architecture models.

For a ``LlamaForCausalLM`` folder without ``tokenizer.model`` (SmolLM2:
a GPT-2-style byte-level BPE ``tokenizer.json``), the converter of the
vendored llama.cpp writes the vocabulary as SentencePiece's ("llama"),
with which llama.cpp cannot tokenize text (a newline has no token: its
tools abort), though token ids pass through unchanged.  Here the
converter's SentencePiece-from-Hugging-Face path declines such a folder,
so that it falls through to its own GPT-2 BPE path, which recognises the
tokenizer's pre-tokenizer.

    python benchmarks/peers/convert_gguf.py LLAMA_CPP_SRC MODEL_DIR
        --outtype f32 --outfile OUT.gguf
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    src = Path(sys.argv[1])
    script = src / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion.base import TextModel
    original = TextModel._set_vocab_llama_hf

    def sentencepiece_only(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise TypeError("a byte-level BPE tokenizer: the GPT-2 path")
        return original(self)

    TextModel._set_vocab_llama_hf = sentencepiece_only
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
