"""Writes a quantized Hugging Face checkpoint of a float folder: the
command line of ``vllm/model_executor/layers/quantization/
spyre_quant_writer.py`` (the formats and their layout are described there
and in docs/quantization.md).  The FP8 input scales are calibrated on
``benchmarks/data/text.txt`` unless ``--calibration`` names another text.

    .venv/bin/python scripts/quantize.py --model models/SmolLM2-135M-Instruct \\
        --format gptq-int4 --out /tmp/smollm2-gptq-int4 \\
        [--group-size N] [--asym] [--lm-head] [--calibration FILE]
"""
import sys
from pathlib import Path

from vllm.model_executor.layers.quantization.spyre_quant_writer import main

TEXT = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "text.txt"

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--calibration" not in argv and TEXT.is_file():
        argv += ["--calibration", str(TEXT)]
    sys.exit(main(argv))
