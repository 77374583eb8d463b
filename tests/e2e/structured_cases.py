"""What the structured-output tests ask for and check, offline
(test_structured_output.py) and through the server
(test_structured_output_server.py)."""
from __future__ import annotations

import json

REGEX = r"[a-c]{3}-\d{2}"
CHOICES = ["spyre", "card", "batch"]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"enum": [1, 2, 3]},
    },
    "required": ["color", "ok", "n"],
    "additionalProperties": False,
}
MAX_NEW = 64


def check_schema(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"color", "ok", "n"}
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    return value
