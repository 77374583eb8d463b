"""Whether the Spyre card's compile backend is installed.

``torch_sendnn`` is the PyTorch bridge to the Spyre compiler: where it
imports, ``torch.compile`` can target the card (``sendnn``); elsewhere the
model runs on the CPU backends.  The settings choose their default backend
by this probe and the platform its dtypes; it imports nothing, so any layer
may ask.
"""
import importlib.util


def sendnn_available() -> bool:
    """True where the Spyre compiler's PyTorch bridge can be imported."""
    return importlib.util.find_spec("torch_sendnn") is not None
