"""The waiting queue around a schedule that did not see the requests whose
grammar compiles (``spyre_pending_grammars.put_back``): they get their
places back, and what the schedule did to the queue stands."""
from __future__ import annotations

from collections import deque

import pytest

from vllm.engine.spyre_pending_grammars import put_back


@pytest.mark.parametrize("order, back, after, expected", [
    # Nothing scheduled: the queue as it was.
    ("abcde", "bd", "ace", "abcde"),
    # The first two scheduled: the held ones ahead of what stayed.
    ("abcde", "bd", "e", "bde"),
    # Everything else scheduled.
    ("abc", "b", "", "b"),
    # A preempted request put at the front by the schedule stays first.
    ("abcd", "c", "Xbd", "Xbcd"),
    # One added behind by the schedule stays last.
    ("abc", "a", "bcY", "abcY"),
    # Held ones only.
    ("ab", "ab", "", "ab"),
])
def test_held_requests_get_their_places_back(order, back, after, expected):
    groups = {name: object() for name in "abcdeXY"}
    queue = put_back([groups[n] for n in order], [groups[n] for n in back],
                     deque(groups[n] for n in after))
    names = {id(g): n for n, g in groups.items()}
    assert "".join(names[id(g)] for g in queue) == expected
