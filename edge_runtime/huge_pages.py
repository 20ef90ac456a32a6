"""Back the memory a session allocated with transparent huge pages (Linux).

ONNX Runtime copies a graph's weights into buffers of its own at session creation (prepacked
for its kernels) and glibc serves most of them from the heap, in 4 KB pages. Decode reads every
weight once per token, so with 4 KB pages it also walks tens of thousands of page-table entries
per token; how much that costs depends on where the buffers land (on the 2-core test machine
the same int4 graph decoded 8-12% slower in a process's first session than in its fourth, and a
session made in the freed memory of the first was slow again). Collapsing the session's memory
into 2 MB pages removes that: every session then decodes like the fastest one
(docs/benchmarks.md).

:func:`anonymous_ranges` snapshots the process's private anonymous mappings (the heap
included); :func:`collapse_new` takes such a snapshot from before the session was made
(``min_resident=0``) and asks
the kernel to back what appeared since with huge pages: ``MADV_HUGEPAGE`` (so khugepaged keeps
them huge) then ``MADV_COLLAPSE`` (Linux 6.1+: at once, synchronously). Only whole 2 MB-aligned
pieces are touched, and memory that existed before the snapshot is left alone, so another
engine in the same process keeps its own pages. Where the kernel lacks ``MADV_COLLAPSE``, the
``MADV_HUGEPAGE`` hint alone remains (khugepaged collapses in the background); where
transparent huge pages are off, or off Linux, nothing is done.

Invariant: only the page size backing the memory changes, never its contents or addresses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
_SMAPS = Path("/proc/self/smaps")
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# a private anonymous read-write mapping (inode 0), unnamed or the heap
_ANON = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) rw-p \S+ 00:00 0\s*(\[heap\])?\s*$")
_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
_RSS = re.compile(r"^Rss:\s+(\d+) kB")
MIN_RESIDENT = 0.5  # mappings less resident than this (thread stacks, reserves) are left alone

Range = tuple[int, int]  # [start, end) in bytes


@dataclass(frozen=True)
class CollapseReport:
    """What :func:`collapse_new` did: bytes offered to the kernel and bytes collapsed now."""

    advised_bytes: int = 0
    collapsed_bytes: int = 0
    seconds: float = 0.0
    note: str = ""

    @property
    def collapsed_mb(self) -> float:
        return self.collapsed_bytes / 2**20


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), or "" if
    unknown (not Linux, or no THP support)."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return ""
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else ""


def collapse_supported() -> bool:
    """Whether ``MADV_COLLAPSE`` can work here: THP on ("always" or "madvise"), Linux 6.1+."""
    if thp_mode() not in ("always", "madvise"):
        return False
    numbers = re.findall(r"\d+", platform.release())[:2]
    return len(numbers) == 2 and (int(numbers[0]), int(numbers[1])) >= (6, 1)


def anonymous_ranges(
    smaps_text: str | None = None, min_resident: float = MIN_RESIDENT
) -> list[Range]:
    """The private anonymous read-write mappings of this process (``/proc/self/smaps``) at
    least ``min_resident`` resident, sorted. Collapsing a sparse mapping (a thread's stack)
    would make resident what was never touched; a snapshot taken *before* a load passes 0, so
    that a mapping which existed then, sparse or not, never counts as new."""
    if smaps_text is None:
        try:
            smaps_text = _SMAPS.read_text()
        except OSError:
            return []
    out = []
    current: Range | None = None
    for line in smaps_text.splitlines():
        if _HEADER.match(line):
            m = _ANON.match(line)
            current = (int(m.group(1), 16), int(m.group(2), 16)) if m else None
        elif current is not None and (rss := _RSS.match(line)):
            if int(rss.group(1)) * 1024 >= min_resident * (current[1] - current[0]):
                out.append(current)
            current = None
    return sorted(out)


def new_ranges(before: Sequence[Range], after: Sequence[Range]) -> list[Range]:
    """Parts of ``after`` covered by no range of ``before`` (both sorted, non-overlapping
    within themselves): new mappings and the grown tails of old ones."""
    out: list[Range] = []
    i = 0
    for lo, hi in after:
        while i < len(before) and before[i][1] <= lo:
            i += 1
        cur, j = lo, i
        while j < len(before) and before[j][0] < hi:
            b_lo, b_hi = before[j]
            if b_lo > cur:
                out.append((cur, b_lo))
            cur = max(cur, b_hi)
            j += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def aligned(ranges: Sequence[Range], page: int = HUGE_PAGE) -> list[Range]:
    """The whole ``page``-aligned pieces inside each range (smaller pieces dropped)."""
    out = []
    for lo, hi in ranges:
        a, b = -(-lo // page) * page, hi // page * page
        if b > a:
            out.append((a, b))
    return out


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    return lib


def collapse_new(before: Sequence[Range]) -> CollapseReport:
    """Back the anonymous memory that appeared since ``before`` with huge pages (see the
    module doc); returns what was done. Never raises for kernel refusals: the memory then
    simply keeps its pages."""
    mode = thp_mode()
    if mode in ("", "never"):
        return CollapseReport(note=f"transparent huge pages unavailable ({mode or 'no THP'})")
    libc = _libc()
    if libc is None:
        return CollapseReport(note="not Linux")
    can_collapse = collapse_supported()
    t0 = time.perf_counter()
    pieces = aligned(new_ranges(before, anonymous_ranges()))
    advised = collapsed = 0
    errors: set[str] = set()
    for lo, hi in pieces:
        if libc.madvise(lo, hi - lo, MADV_HUGEPAGE) == 0:
            advised += hi - lo
        if can_collapse and libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            collapsed += hi - lo
        elif can_collapse:  # EINVAL: a piece it cannot collapse; EAGAIN/ENOMEM: memory busy
            errors.add(os.strerror(ctypes.get_errno()))
    note = f"some pieces not collapsed: {', '.join(sorted(errors))}" if errors else ""
    if not can_collapse:
        note = "no MADV_COLLAPSE before Linux 6.1: hinted only (khugepaged collapses later)"
    return CollapseReport(advised, collapsed, time.perf_counter() - t0, note)
