"""edge_runtime.huge_pages: range arithmetic, smaps parsing, and a real collapse."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import numpy as np
import pytest

from edge_runtime import huge_pages as hp


def test_new_ranges_are_the_parts_not_covered_before() -> None:
    before = [(0, 10), (20, 30), (40, 50)]
    after = [(0, 35), (40, 60), (70, 80)]  # a grown mapping merged over a hole, a grown tail, new
    assert hp.new_ranges(before, after) == [(10, 20), (30, 35), (50, 60), (70, 80)]
    assert hp.new_ranges(after, after) == []
    assert hp.new_ranges([], after) == after


def test_aligned_keeps_whole_huge_pages_only() -> None:
    mb = 1 << 20
    got = hp.aligned([(1 * mb, 7 * mb), (8 * mb, 9 * mb), (10 * mb, 12 * mb)])
    assert got == [(2 * mb, 6 * mb), (10 * mb, 12 * mb)]


SMAPS = """\
55d0a0000000-55d0a0800000 rw-p 00000000 00:00 0                          [heap]
Size:               8192 kB
Rss:                8000 kB
7f0000000000-7f0000800000 rw-p 00000000 00:00 0
Size:               8192 kB
Rss:                  16 kB
7f0001000000-7f0001400000 rw-p 00000000 00:00 0
Size:               4096 kB
Rss:                4096 kB
7f0002000000-7f0002400000 r--p 00000000 08:01 1234                       /usr/lib/libfoo.so
Size:               4096 kB
Rss:                4096 kB
7f0003000000-7f0003400000 rw-p 00000000 08:01 99                         /tmp/mapped.bin
Size:               4096 kB
Rss:                4096 kB
"""


def test_anonymous_ranges_skip_files_and_sparse_mappings() -> None:
    # the heap and the dense anonymous mapping; not the sparse one (a thread stack), not files
    assert hp.anonymous_ranges(SMAPS) == [
        (0x55D0A0000000, 0x55D0A0800000),
        (0x7F0001000000, 0x7F0001400000),
    ]
    # a snapshot before a load keeps the sparse one too: it existed, so it is never "new"
    assert hp.anonymous_ranges(SMAPS, min_resident=0.0) == [
        (0x55D0A0000000, 0x55D0A0800000),
        (0x7F0000000000, 0x7F0000800000),
        (0x7F0001000000, 0x7F0001400000),
    ]


def _anon_huge_kb(lo: int, hi: int) -> int:
    """AnonHugePages of the mappings overlapping [lo, hi)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not hp.collapse_supported(), reason="needs THP and Linux 6.1+ (MADV_COLLAPSE)")
def test_collapse_new_backs_new_memory_with_huge_pages_and_keeps_contents() -> None:
    old = np.arange(8 << 18, dtype=np.float32)  # made before the snapshot: left alone
    before = hp.anonymous_ranges(min_resident=0.0)
    # A mapping of its own, so that the memory is new whatever malloc kept from earlier tests
    # (an array from malloc may reuse a freed chunk of the heap, which existed before).
    region = mmap.mmap(-1, 32 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(region, dtype=np.float32)
    data[:] = np.arange(data.size, dtype=np.float32)  # 32 MB, every page touched
    expect = np.arange(data.size, dtype=np.float32)
    lo = data.__array_interface__["data"][0]
    report = hp.collapse_new(before)
    assert report.collapsed_bytes >= 28 << 20  # whole aligned 2 MB pieces of 32 MB (and more)
    assert _anon_huge_kb(lo, lo + data.nbytes) >= 28 << 10
    np.testing.assert_array_equal(data, expect)
    assert old[-1] == (8 << 18) - 1
