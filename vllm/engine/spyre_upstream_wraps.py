"""Wrapping an upstream vLLM method, once.

The ``vllm.general_plugins`` entry points of the Spyre backend
(``spyre_admission``, ``spyre_pending_grammars``, the OpenAI server's
``spyre_error_status`` and ``spyre_request_checks``) correct upstream's
V0 request handling by replacing a method of an upstream class (or a
function of a module) with a wrapper around it.  vLLM may load a plugin
more than once in a process, so ``wrap_once`` marks its wrappers and
never wraps one of them again.
"""
from __future__ import annotations

import functools

_INSTALLED_MARK = "_spyre_wrapper"


def wrap_once(owner, name: str, make_wrapper) -> None:
    """Replaces ``owner.name`` (a class's method or a module's function)
    with ``make_wrapper(original)``, unless it is already such a wrapper."""
    original = getattr(owner, name)
    if getattr(original, _INSTALLED_MARK, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _INSTALLED_MARK, True)
    setattr(owner, name, wrapper)
