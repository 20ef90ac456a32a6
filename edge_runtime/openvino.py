"""The OpenVINO execution provider: which device a session really got, and what it implies.

``onnxruntime-openvino`` asked for a device it cannot find (``device_type=NPU`` on a machine
without one) logs an error and builds a session all the same: 1.24.1 without the OpenVINO
provider (a plain CPU session, which ``providers.create_session`` sees and passes over); a
release that kept the provider would run on OpenVINO's CPU. The session's provider options
do not say which device it got (1.24.1 returns none), so the asked-for device is checked
against the devices OpenVINO sees, and a node reports ``"OpenVINO:<device>"`` for the one it
really runs on.

Invariants:
- The graph form on OpenVINO is ``concat`` (standard ops only; measured with onnxruntime-openvino
  1.24.1: its fp32 and int8 graphs run whole on the EP, int4 all but its embedding's
  ``GatherBlockQuantized``): our ``gqa`` graph's ``com.microsoft.GroupQueryAttention`` has no
  OpenVINO kernel, so that graph is split, each layer's attention on the CPU provider
  (``attention_for``).
- A stateful compile (``enable_causallm``: the KV cache lives inside the compiled model, as
  an Intel NPU needs) cannot reuse a prefix across requests: ``stateful`` says so and the
  engine turns its prefix reuse off for it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import onnxruntime as ort

from edge_runtime.graph_info import GraphInfo

if TYPE_CHECKING:
    from edge_runtime.providers import ProviderSpec

log = logging.getLogger(__name__)

OPENVINO = "OpenVINOExecutionProvider"
SHORT = "OpenVINO"


def available_devices() -> list[str] | None:
    """The devices OpenVINO sees here (``["CPU"]``, ``["CPU", "GPU", "NPU"]``, ...), or None
    when this onnxruntime has no OpenVINO provider."""
    probe = getattr(ort.capi._pybind_state, "get_available_openvino_device_ids", None)
    if probe is None:
        return None
    try:
        return [str(d) for d in probe()]
    except Exception as exc:  # the provider library failed to load
        log.warning("OpenVINO devices unknown: %s: %s", type(exc).__name__, exc)
        return None


def _asked(device_type: str) -> list[str]:
    """The plain device names in a ``device_type`` (``"AUTO:GPU,CPU"`` -> ``["GPU", "CPU"]``,
    ``"GPU.1"`` -> ``["GPU.1"]``, ``"HETERO:NPU,CPU"`` -> ``["NPU", "CPU"]``)."""
    _, _, tail = device_type.rpartition(":")
    return [d.strip().upper() for d in tail.split(",") if d.strip()]


def real_device(options: Mapping[str, str], devices: Sequence[str] | None) -> str:
    """The device a session asked for with ``options`` really runs on, given the ``devices``
    OpenVINO sees: the first asked-for device present, else ``"CPU"`` (the EP's silent
    fallback); the asked-for device itself when the devices are unknown."""
    asked = _asked(options.get("device_type") or "CPU") or ["CPU"]
    if devices is None:
        return asked[0]
    seen = {d.upper() for d in devices}
    for name in asked:
        if name in seen or name.split(".")[0] in {s.split(".")[0] for s in seen}:
            return name
    log.error(
        "OpenVINO was asked for %s but sees only %s: the session runs on CPU",
        "/".join(asked),
        ", ".join(devices) or "nothing",
    )
    return "CPU"


def session_device(options: Mapping[str, str]) -> str:
    """``"OpenVINO:<device>"``: the device a session created on the OpenVINO provider with
    ``options`` runs on."""
    return f"{SHORT}:{real_device(options, available_devices())}"


def runs_here(options: Mapping[str, str]) -> bool:
    """Whether OpenVINO sees a device ``options`` ask for (so the provider will be created)."""
    devices = available_devices()
    if devices is None:
        return False
    seen = {d.upper().split(".")[0] for d in devices}
    asked = _asked(options.get("device_type") or "CPU") or ["CPU"]
    return any(a.split(".")[0] in seen for a in asked)


def stateful(options: Mapping[str, str]) -> bool:
    """Whether ``options`` ask for a stateful (causal LM) compile: KV inside the model."""
    return str(options.get("enable_causallm", "")).strip().lower() in ("1", "true", "yes")


def decoder_info(info: GraphInfo) -> GraphInfo:
    """``info`` as the decoder must see it on OpenVINO: without ``logits_to_keep``.

    OpenVINO folds an initializer that is also a graph input into a constant and ignores the
    value fed (measured: logits ``[1, 16, vocab]`` for a 16-token chunk fed ``logits_to_keep``
    1), so the graph returns every position's logits and the decoder takes the last itself;
    a prompt chunk runs the LM head on each of its tokens."""
    return replace(info, has_logits_to_keep=False)


def attention_for(spec: ProviderSpec) -> str:
    """The graph form the provider of ``spec`` runs whole: ``concat`` on OpenVINO where it sees
    the asked-for device, else ``gqa``."""
    return "concat" if spec.name == OPENVINO and runs_here(spec.options) else "gqa"
