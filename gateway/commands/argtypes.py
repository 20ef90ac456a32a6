"""argparse ``type=`` checkers: a bad value is one usage line (exit 2) naming the flag."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from routing.power import Watts


def _bounded(
    kind: Callable[[str], float], low: float | None, high: float | None, what: str
) -> Callable[[str], float]:
    def check(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value

    check.__name__ = what  # argparse names the type in its messages
    return check


positive_int = _bounded(int, 1, None, "a whole number of at least 1")
nonneg_int = _bounded(int, 0, None, "a whole number of at least 0")
port = _bounded(int, 0, 65535, "a port number (0-65535)")
positive_float = _bounded(float, 1e-9, None, "a number above 0")
nonneg_float = _bounded(float, 0, None, "a number of at least 0")
temperature = _bounded(float, 0, 2, "a temperature in [0, 2]")
probability = _bounded(float, 1e-9, 1, "a probability in (0, 1]")


def torch_device(text: str) -> str:
    """A cloud node's ``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    head, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (head == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: cuda, cuda:N, cpu or auto")


def serve_cloud_device(text: str) -> str:
    """``serve``'s ``--cloud-device``: a :func:`torch_device`, or ``off`` (no cloud node)."""
    if text == "off":
        return text
    try:
        return torch_device(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device: cuda, cuda:N, cpu, auto or off"
        ) from None


def cloud_stall_ratio(text: str) -> float | Literal["off"]:
    """The cloud's ``--prefill-stall-ratio``: as :func:`stall_ratio`, ``off`` kept as said (an
    unset flag is the device's default)."""
    ratio = stall_ratio(text)
    return "off" if ratio is None else ratio


def stall_ratio(text: str) -> float | None:
    """``--prefill-stall-ratio``: a number of at least 0, or ``off`` (full chunks always)."""
    if text.strip().lower() == "off":
        return None
    return _bounded(float, 0, 1000, "a number in [0, 1000] or 'off'")(text)


KV_DTYPES = ("auto", "bf16", "fp8", "int8")  # = cloud_engine.kv_quant.KV_CHOICES (no torch here)


def kv_dtype(text: str) -> str:
    """``--kv-dtype``: one of :data:`KV_DTYPES`."""
    value = text.strip().lower()
    if value not in KV_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(KV_DTYPES)}")
    return value


def pp_spec(text: str) -> tuple[int, str | None]:
    """``--pp``: ``STAGES`` or ``STAGES:LAYERS`` (``balanced``, or one count per stage)."""
    stages, _, layers = text.partition(":")
    return int(positive_int(stages)), (layers.strip() or None)


def watts(text: str) -> Watts:
    """``--watts``: ``IDLE:LOAD`` in watts (a :class:`routing.power.Watts`)."""
    from routing.power import parse_watts

    try:
        return parse_watts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
