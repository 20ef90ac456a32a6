"""Execution-provider choice: the first provider of a preference list that creates a session.

Invariants:
- Providers the installed onnxruntime does not offer are skipped without trying them.
- A provider whose session creation raises is recorded as failed and the next one is tried.
- CPU is always the last resort: it is appended to any preference list that lacks it.
- Every provider other than CPU is registered with CPU behind it, so nodes it cannot run
  (e.g. ``GroupQueryAttention`` on an NPU) fall back to CPU inside the one session.
- QNN is the ``onnxruntime-qnn`` plugin EP where that package offers one (:mod:`edge_runtime.qnn`):
  registered on first use and selected by device; without it QNN is skipped with the reason.
- :class:`ProviderChoice` records which provider is active and why each earlier one was not.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnxruntime as ort

from edge_runtime import qnn

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"


@dataclass(frozen=True)
class ProviderSpec:
    name: str
    options: dict[str, str] = field(default_factory=dict)


def _qnn_backend() -> str:
    return "QnnHtp.dll" if sys.platform == "win32" else "libQnnHtp.so"


# NPU first, then other accelerators, then CPU.
DEFAULT_PREFERENCE: tuple[ProviderSpec, ...] = (
    ProviderSpec("QNNExecutionProvider", {"backend_path": _qnn_backend()}),
    ProviderSpec("OpenVINOExecutionProvider", {"device_type": "NPU"}),
    ProviderSpec("VitisAIExecutionProvider"),
    ProviderSpec("CoreMLExecutionProvider"),
    ProviderSpec("DmlExecutionProvider"),
    ProviderSpec(CPU),
)

ALIASES = {
    "qnn": "QNNExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "vitisai": "VitisAIExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "dml": "DmlExecutionProvider",
    "directml": "DmlExecutionProvider",
    "cpu": CPU,
}


def parse_provider(text: str | ProviderSpec) -> ProviderSpec:
    """``"openvino:device_type=NPU,precision=FP16"`` or a full provider name, as a spec.

    A bare alias of a provider in :data:`DEFAULT_PREFERENCE` keeps that entry's options.
    """
    if isinstance(text, ProviderSpec):
        return text
    name, _, opts = text.partition(":")
    full = ALIASES.get(name.strip().lower(), name.strip())
    options: dict[str, str] = {}
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"provider option {item!r} is not key=value")
        options[key.strip()] = value.strip()
    if not opts:
        default = next((p for p in DEFAULT_PREFERENCE if p.name == full), None)
        if default is not None:
            return default
    return ProviderSpec(full, options)


@dataclass(frozen=True)
class ProviderAttempt:
    name: str
    outcome: str  # "active" | "skipped" | "failed"
    reason: str = ""


@dataclass(frozen=True)
class ProviderChoice:
    active: str
    attempts: tuple[ProviderAttempt, ...]
    # what the session really runs on ("OpenVINO:CPU"); "" where the provider name says it
    device: str = ""
    stateful: bool = False  # the KV cache lives inside the compiled model: no prefix reuse

    @property
    def skipped(self) -> dict[str, str]:
        """Provider name -> why it is not the active one."""
        return {a.name: a.reason for a in self.attempts if a.outcome != "active"}

    @property
    def short_name(self) -> str:
        """``"CPU"``, ``"QNN"``, ... (the provider name without ``ExecutionProvider``)."""
        return self.active.removesuffix("ExecutionProvider")

    @property
    def label(self) -> str:
        """The device to report: ``device`` if known, else :attr:`short_name`."""
        return self.device or self.short_name


def first_offered(
    preference: Sequence[str | ProviderSpec] | None = None, available: Sequence[str] | None = None
) -> ProviderSpec:
    """The first provider of ``preference`` this onnxruntime offers (the one a session will
    try first; CPU when none is)."""
    offered = set(available if available is not None else ort.get_available_providers())
    specs = [parse_provider(p) for p in (preference or DEFAULT_PREFERENCE)]
    return next((s for s in specs if s.name in offered), ProviderSpec(CPU))


def _describe(spec: ProviderSpec) -> tuple[str, bool]:
    """(the device a session made with ``spec`` really runs on, or "" where its provider
    says it; whether it is a stateful compile)."""
    from edge_runtime import openvino

    if spec.name == openvino.OPENVINO:
        return openvino.session_device(spec.options), openvino.stateful(spec.options)
    return "", False


def default_threads() -> int:
    """Intra-op threads: the CPUs this process may run on, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def session_options(threads: int | None = None, spin: bool = True) -> ort.SessionOptions:
    """Full graph optimizations, sequential execution, ``threads`` intra-op threads.

    ``spin=False`` stops idle intra-op threads from busy-waiting (friendlier to other work
    on a small box, a little slower per token).
    """
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or default_threads()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    so.log_severity_level = 3
    return so


SessionFactory = Callable[..., ort.InferenceSession]


def create_session(
    graph_path: Path,
    preference: Sequence[str | ProviderSpec] | None = None,
    options_factory: Callable[[], ort.SessionOptions] = session_options,
    session_factory: SessionFactory = ort.InferenceSession,
    available: Sequence[str] | None = None,
) -> tuple[ort.InferenceSession, ProviderChoice]:
    """Create a session on the first provider of ``preference`` that works.

    Raises RuntimeError (with every provider's reason) only if even CPU fails.
    """
    specs = [parse_provider(p) for p in (preference or DEFAULT_PREFERENCE)]
    if not any(s.name == CPU for s in specs):
        specs.append(ProviderSpec(CPU))
    qnn_missing = ""  # why the QNN plugin is not registered (where QNN is asked for)
    if available is None and any(s.name == qnn.EP_NAME for s in specs):
        qnn_missing = qnn.try_register()
    offered = set(available if available is not None else ort.get_available_providers())
    attempts: list[ProviderAttempt] = []
    for spec in specs:
        if spec.name not in offered:
            why = "not offered by this onnxruntime"
            if spec.name == qnn.EP_NAME and qnn_missing:
                why += f" ({qnn_missing})"
            attempts.append(ProviderAttempt(spec.name, "skipped", why))
            continue
        providers: list[tuple[str, dict[str, Any]]] = [(spec.name, dict(spec.options))]
        if spec.name != CPU:
            providers.append((CPU, {}))
        try:
            if spec.name == qnn.EP_NAME and qnn.is_registered():  # plugin EP: chosen by device
                so = qnn.add_to_session_options(options_factory(), spec.options)
                session = session_factory(str(graph_path), sess_options=so)
                if qnn.nodes_on(session) == 0:  # e.g. dynamic shapes: all of it fell to CPU
                    raise RuntimeError("QNN took no node of this graph (HTP needs static shapes)")
            else:
                session = session_factory(
                    str(graph_path), sess_options=options_factory(), providers=providers
                )
        except Exception as exc:  # any EP error: driver missing, bad options, unsupported graph
            reason = f"session creation failed: {type(exc).__name__}: {str(exc)[:300]}"
            log.warning("%s: %s", spec.name, reason)
            attempts.append(ProviderAttempt(spec.name, "failed", reason))
            continue
        registered = session.get_providers()
        if not registered or registered[0] != spec.name:
            reason = f"session created without it (providers: {registered})"
            attempts.append(ProviderAttempt(spec.name, "failed", reason))
            continue
        attempts.append(ProviderAttempt(spec.name, "active"))
        device, stateful = _describe(spec)
        choice = ProviderChoice(spec.name, tuple(attempts), device, stateful)
        log.info("execution provider %s (skipped: %s)", choice.label, choice.skipped or "none")
        return session, choice
    detail = "; ".join(f"{a.name}: {a.reason}" for a in attempts)
    raise RuntimeError(f"no execution provider could create a session: {detail}")
