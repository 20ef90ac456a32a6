"""One progress line per long step (download, import, export, quantization, warm-up), with the
time it took, and the libraries' noise kept out of sight.

``with step("exporting ONNX graph (fp32)"):`` shows one line on stderr (a live tqdm line with
the elapsed time on a terminal; a start line and an end line otherwise), then
``✓ exporting ONNX graph (fp32) (52.3 s)``. Everything the step's libraries write meanwhile
(torch.onnx's prints, onnx_ir/onnxscript/quantizer log records, "Failed to get schema" stack
dumps, warnings) goes to a temporary file at the file-descriptor level, so C++ output is caught
too; it is replayed on stderr if the step fails, and passed straight through when verbose.

Verbose is ``$EDGECLOUD_VERBOSE`` (``edgecloud -v`` sets it, so child processes inherit it);
``$EDGECLOUD_QUIET`` drops the progress lines too. Steps nest: an inner step inside a captured
one is captured with it (its lines go to the real stderr all the same).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from typing import IO

VERBOSE_ENV = "EDGECLOUD_VERBOSE"
QUIET_ENV = "EDGECLOUD_QUIET"

_lock = threading.Lock()
_depth = 0
_out: IO[str] | None = None  # the real stderr while a capture is active


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


def configure(*, verbose: bool = False, quiet: bool = False) -> None:
    """Set the mode for this process and its children (the CLI's ``-v`` / ``-q``)."""
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    os.environ[QUIET_ENV] = "1" if quiet and not verbose else "0"


def _stream() -> IO[str]:
    return _out if _out is not None else sys.stderr


def _fmt(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def note(message: str) -> None:
    """One line on the real stderr (unless quiet), even inside a captured step."""
    if not quiet():
        print(message, file=_stream(), flush=True)


class _Live:
    """A tqdm line with the elapsed time, refreshed by a thread while the step runs."""

    def __init__(self, label: str, out: IO[str]) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=None, desc=label, file=out, bar_format="{desc}... {elapsed}", leave=False
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            self.bar.refresh()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.bar.close()


@contextlib.contextmanager
def _captured() -> Iterator[IO[bytes]]:
    """Route fds 1 and 2 (and Python's warnings and log records) to a temporary file."""
    global _out
    sys.stdout.flush()
    sys.stderr.flush()
    log_file = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    saved = os.dup(1), os.dup(2)
    real = os.fdopen(os.dup(saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
    previous_out = _out
    _out = real
    root = logging.getLogger()
    old_level = root.level
    os.dup2(log_file.fileno(), 1)
    os.dup2(log_file.fileno(), 2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if old_level < logging.WARNING:  # INFO records of the quantizer's root logger
                root.setLevel(logging.WARNING)
            yield log_file
    finally:
        root.setLevel(old_level)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        _out = previous_out
        real.close()
        log_file.close()


@contextlib.contextmanager
def step(label: str) -> Iterator[None]:
    """Run a long step under one progress line; library output shown only if verbose or on
    failure (then replayed, last 200 lines, before the exception propagates)."""
    global _depth
    show = not quiet()
    t0 = time.perf_counter()
    with _lock:
        _depth += 1
        outer = _depth == 1
    try:
        if verbose() or not outer:
            if show:
                note(f"{label}...")
            yield
        else:
            with _captured() as log_file:
                assert _out is not None
                live = _Live(label, _out) if show and _out.isatty() else None
                if show and live is None:
                    note(f"{label}...")
                try:
                    yield
                except BaseException:
                    if live is not None:
                        live.close()
                    _replay(log_file, _out)
                    raise
                if live is not None:
                    live.close()
    finally:
        with _lock:
            _depth -= 1
    if show:
        note(f"✓ {label} ({_fmt(time.perf_counter() - t0)})")


def _replay(log_file: IO[bytes], out: IO[str], tail: int = 200) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    log_file.seek(0)
    lines = log_file.read().decode("utf-8", "replace").splitlines()
    if not lines:
        return
    if len(lines) > tail:
        print(f"... ({len(lines) - tail} earlier lines of library output)", file=out)
    for line in lines[-tail:]:
        print(line, file=out)
    out.flush()
