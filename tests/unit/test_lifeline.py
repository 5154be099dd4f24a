"""parlay.lifeline's pieces that need no launcher: whole lines and groups outliving shutdown."""
from __future__ import annotations

import gc
import io

import pytest

from parlay import lifeline

pytestmark = pytest.mark.timeout(30)


class _Recorder(io.RawIOBase):
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.writes.append(bytes(b))
        return len(b)


def test_whole_lines_turns_an_unbuffered_stream_into_one_write_per_line():
    raw = _Recorder()
    stream = io.TextIOWrapper(raw, write_through=True)   # what PYTHONUNBUFFERED gives
    print("a", 1, file=stream)
    assert raw.writes == [b"a", b" ", b"1", b"\n"]       # four writes: other ranks splice in
    raw.writes.clear()
    lifeline.whole_lines([stream])
    print("a", 1, file=stream)
    print("partial", end="", file=stream)
    assert raw.writes == [b"a 1\n"]                     # the partial line waits for its newline
    print(" rest", file=stream)
    assert raw.writes == [b"a 1\n", b"partial rest\n"]


def test_whole_lines_leaves_other_streams_alone():
    lifeline.whole_lines([io.StringIO(), object()])     # no reconfigure, no error


class _Group:
    pass


def test_settle_groups_counts_the_groups_an_object_still_holds():
    lifeline.settle_groups(0)                            # forget earlier tests' groups
    held, dropped = _Group(), _Group()
    lifeline.track_groups([held, dropped, 3])            # 3: not weak-referenceable, skipped
    del dropped
    gc.collect()
    assert lifeline.settle_groups(0) == 1
    del held
    gc.collect()
    assert lifeline.settle_groups(0) == 0
