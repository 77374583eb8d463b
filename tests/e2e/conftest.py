"""Every test under tests/e2e builds engines, servers or compiled models:
marked ``e2e`` here, once (``make test-unit`` leaves them out)."""
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
