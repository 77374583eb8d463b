"""vllm-spyre-intree: IBM Spyre support for vLLM's V0 engine.

The wheel holds namespace portions only: modules under ``vllm/`` that land
next to upstream vLLM's own files, without any ``__init__.py`` of ours, plus
the ``vllm.platform_plugins`` entry point that makes vLLM select the Spyre
platform in every process, and ``vllm.general_plugins`` entry points that
correct upstream V0 request handling on Spyre and shorten its start-up
(see the modules they name).
"""
from pathlib import Path

from setuptools import find_namespace_packages, setup


def requirements(name: str) -> list[str]:
    """The requirement lines of ``name``, without comments."""
    path = Path(__file__).resolve().parent / name
    if not path.exists():  # building from an archive without it
        return []
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]

setup(
    name="vllm-spyre-intree",
    version="0.1.0",
    description="IBM Spyre accelerator support for vLLM (V0 engine)",
    license="Apache-2.0",
    python_requires=">=3.10",
    # `pip install .[dev]`: tests, benchmarks, examples' clients and
    # lm-evaluation-harness (docs/evaluation.md); never needed to serve.
    extras_require={"dev": requirements("requirements-dev.txt")},
    packages=find_namespace_packages(include=["vllm", "vllm.*"]),
    # C++ sources built on first use (torch.utils.cpp_extension.load).
    package_data={"vllm.spyre_kernels": ["*.cpp", "*.h"]},
    entry_points={
        "vllm.platform_plugins": ["spyre = vllm.platforms.spyre:register"],
        "vllm.general_plugins": [
            "spyre_admission = vllm.engine.spyre_admission:install",
            "spyre_pending_grammars = "
            "vllm.engine.spyre_pending_grammars:install",
            "spyre_parallel_streams = "
            "vllm.engine.spyre_parallel_streams:install",
            "spyre_spec_outputs = vllm.engine.spyre_spec_outputs:install",
            "spyre_spec_config = vllm.engine.spyre_spec_config:install",
            "spyre_image_prefix = vllm.engine.spyre_image_prefix:install",
            "spyre_error_status = "
            "vllm.entrypoints.openai.spyre_error_status:install",
            "spyre_request_checks = "
            "vllm.entrypoints.openai.spyre_request_checks:install",
            "spyre_model_inspection = "
            "vllm.model_executor.models.spyre_inspection:install",
            "spyre_quantization = "
            "vllm.model_executor.layers.quantization.spyre_quant:install",
        ],
    },
)
