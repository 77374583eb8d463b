"""Where the repository and its provisioned models are."""
from __future__ import annotations

from pathlib import Path

#: The repository (the package is installed from ``support/`` in place).
REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"
#: The default model (``scripts/provision_model.py``).
SMOLLM2_DIR = MODELS / "SmolLM2-135M-Instruct"
#: The default embedding model.
MINILM_DIR = MODELS / "all-MiniLM-L6-v2"
