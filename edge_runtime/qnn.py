"""The QNN execution provider as an ONNX Runtime plugin EP (PyPI's ``onnxruntime-qnn`` >= 2.0).

``onnxruntime-qnn`` ships ``libonnxruntime_providers_qnn.so`` and the QNN backends (``libQnnHtp.so``
...) but not ONNX Runtime itself: it plugs into the separately installed ``onnxruntime``. The
library is registered with ``ort.register_execution_provider_library`` and a session selects it
with ``SessionOptions.add_provider_for_devices``, not by the legacy ``providers=[...]`` name.

Invariants:
- The library is registered at most once per process (an existing registration is reused).
- Nothing here imports ``onnxruntime_qnn`` before a function is called: a process without the
  package pays nothing, and :func:`try_register` says why QNN is unavailable instead of raising.
- A bare backend file name in the options (``libQnnHtp.so``) means the one the package ships.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import onnxruntime as ort

EP_NAME = "QNNExecutionProvider"
PLUGIN_MODULE = "onnxruntime_qnn"  # PyPI: onnxruntime-qnn

# session config keys (onnxruntime_session_options_config_keys.h)
DISABLE_CPU_FALLBACK = "session.disable_cpu_ep_fallback"
CONTEXT_ENABLE = "ep.context_enable"
CONTEXT_FILE_PATH = "ep.context_file_path"
CONTEXT_EMBED_MODE = "ep.context_embed_mode"
RECORD_ASSIGNMENT = "session.record_ep_graph_assignment_info"  # for :func:`nodes_on`

_lock = threading.Lock()


class PluginUnavailable(RuntimeError):
    """The QNN plugin EP cannot be used in this process; the message says why."""


@dataclass(frozen=True)
class Plugin:
    """The installed plugin: its EP library, the folder of its QNN backends, its version."""

    library: Path
    lib_dir: Path
    version: str

    def backend(self, name: str) -> Path:
        """``"htp"`` -> the package's ``libQnnHtp.so`` (``QnnHtp.dll`` on Windows)."""
        base = {"htp": "QnnHtp", "gpu": "QnnGpu", "cpu": "QnnCpu"}[name]
        return self.lib_dir / (f"{base}.dll" if sys.platform == "win32" else f"lib{base}.so")


def _import_plugin_module() -> ModuleType:
    return importlib.import_module(PLUGIN_MODULE)


def find_plugin() -> Plugin:
    """The plugin the installed ``onnxruntime-qnn`` offers; raises PluginUnavailable if none."""
    if not hasattr(ort, "register_execution_provider_library"):
        raise PluginUnavailable(
            f"onnxruntime {ort.__version__} has no plugin-EP API (needs >= 1.23)"
        )
    try:
        mod = _import_plugin_module()
    except ImportError as exc:
        raise PluginUnavailable(f"onnxruntime-qnn is not installed ({exc})") from exc
    get_path = getattr(mod, "get_library_path", None)
    if get_path is None:  # the pre-2.0 package: QNN built into its own onnxruntime, no plugin
        raise PluginUnavailable("onnxruntime_qnn offers no plugin library (get_library_path)")
    library = Path(get_path())
    if not library.is_file():
        raise PluginUnavailable(f"onnxruntime-qnn's plugin library {library} is missing")
    return Plugin(library, library.parent, str(getattr(mod, "__version__", "?")))


def ep_devices() -> list[ort.OrtEpDevice]:
    """The devices ONNX Runtime pairs with the QNN EP (empty until the library is registered)."""
    if not hasattr(ort, "get_ep_devices"):
        return []
    return [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]


def register() -> Plugin:
    """Register the plugin library once (idempotent); raises PluginUnavailable with the reason."""
    plugin = find_plugin()
    with _lock:
        if not ep_devices():
            ort.register_execution_provider_library(EP_NAME, str(plugin.library))
        if not ep_devices():
            raise PluginUnavailable(f"{plugin.library} registered but offers no device")
    return plugin


def try_register() -> str:
    """:func:`register`, returning ``""`` on success or the reason QNN is unavailable."""
    try:
        register()
    except PluginUnavailable as exc:
        return str(exc)
    except Exception as exc:  # the library failed to load: a wrong onnxruntime, missing deps
        return f"registering the QNN plugin failed: {type(exc).__name__}: {str(exc)[:300]}"
    return ""


def is_registered() -> bool:
    """Whether this process has the QNN plugin registered (then sessions use it by device)."""
    return bool(ep_devices())


def ep_options(options: Mapping[str, str] | None = None) -> dict[str, str]:
    """Provider options for the plugin: HTP unless told otherwise; bare backend names resolved."""
    opts = dict(options or {})
    if "backend_path" not in opts:
        opts.setdefault("backend_type", "htp")
    elif "/" not in opts["backend_path"] and "\\" not in opts["backend_path"]:
        shipped = find_plugin().lib_dir / opts["backend_path"]
        if shipped.is_file():
            opts["backend_path"] = str(shipped)
    return opts


def add_to_session_options(
    so: ort.SessionOptions,
    options: Mapping[str, str] | None = None,
    cpu_fallback: bool = True,
) -> ort.SessionOptions:
    """Register the plugin if needed and put QNN into ``so`` (returned, modified in place).

    ``cpu_fallback=False`` makes session creation raise unless QNN takes every node.
    """
    register()
    so.add_session_config_entry(RECORD_ASSIGNMENT, "1")
    if not cpu_fallback:
        so.add_session_config_entry(DISABLE_CPU_FALLBACK, "1")
    so.add_provider_for_devices(ep_devices(), ep_options(options))
    return so


def nodes_on(session: ort.InferenceSession, ep: str = EP_NAME) -> int | None:
    """How many graph nodes ``ep`` runs in ``session`` (made with :func:`add_to_session_options`);
    None where this onnxruntime cannot say. 0 means QNN is registered but runs nothing."""
    get_info = getattr(session, "get_provider_graph_assignment_info", None)
    if get_info is None:
        return None
    try:
        subgraphs = get_info()
    except Exception:  # recording was not enabled for this session
        return None
    return sum(len(sg.get_nodes()) for sg in subgraphs if sg.ep_name == ep)


def htp_session_options(
    context_path: Path | None = None,
    embed_context: bool = False,
    cpu_fallback: bool = False,
    options: Mapping[str, str] | None = None,
) -> ort.SessionOptions:
    """Session options for the HTP backend, CPU fallback off by default.

    With ``context_path`` (``*_ctx.onnx``), creating a session compiles the graph and writes the
    precompiled context there (and its ``*_qnn.bin`` beside it unless ``embed_context``);
    loading that file later skips the compile. Use it only for a QDQ graph, not a context one.
    """
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if context_path is not None:
        so.add_session_config_entry(CONTEXT_ENABLE, "1")
        so.add_session_config_entry(CONTEXT_FILE_PATH, str(context_path))
        so.add_session_config_entry(CONTEXT_EMBED_MODE, "1" if embed_context else "0")
    return add_to_session_options(so, options, cpu_fallback)  # HTP unless options say otherwise
