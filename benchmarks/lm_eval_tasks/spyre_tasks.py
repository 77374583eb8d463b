"""Datasets of the local lm-evaluation-harness tasks in this folder.

Each task's YAML names ``load`` as its ``custom_dataset`` and gives its
JSON-lines file in ``dataset_kwargs``; the file is read from this folder,
wherever lm-eval runs, and nothing is fetched from a dataset hub.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(file: str, **_):
    """The JSON-lines ``file`` of this folder as a dataset with one split,
    ``test``; other keyword arguments (the task's metadata) are ignored."""
    import datasets
    with open(HERE / file) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
