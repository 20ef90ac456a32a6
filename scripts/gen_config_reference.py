#!/usr/bin/env python3
"""Generate docs/configuration.md (every setting of the gateway YAML and the policy YAML, from
the pydantic models, and every command's flags, from the argument parsers) and
examples/policy.yaml (every policy knob at its default, with its meaning).

Usage: python scripts/gen_config_reference.py [--check]
(--check: exit 1 if a committed file differs from what would be generated; the tests do this).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DOC = REPO / "docs" / "configuration.md"
POLICY_EXAMPLE = REPO / "examples" / "policy.yaml"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes inside a field's type (``X``, ``X | None``, ``list[X]``, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out.extend(_models_in(arg))
    return out


def _type_name(annotation: Any) -> str:
    if annotation is None or annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if isinstance(annotation, type):
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation)


# Meanings of knobs whose models (not owned here) carry no description, keyed by model.field.
MEANINGS = {
    "OutputKnobs.default_tokens": "expected output tokens of a request with no history",
    "OutputKnobs.alpha": "EWMA weight of a new output length, per (key, route)",
    "CircuitKnobs.half_open_probes": "trial requests let through a half-open breaker",
    "RegionKnobs.rtt_overrides": "measured RTTs: [{a, b, ms}], used as is",
    "ApiKeyEntry.key_hash": "hash_key(key, salt): hmac-sha256:<hex>",
    "ApiKeyEntry.rpm": "requests per minute (none: auth.default_rpm)",
    "ApiKeyEntry.tpm": "tokens per minute (none: auth.default_tpm)",
    "ApiKeyEntry.name": "who the key belongs to (metrics, logs)",
    "AdminKeyEntry.name": "who the key belongs to",
    "AdminKeyEntry.key_hash": "hash_key(key, salt)",
    "AuthConfig.keys": "user API keys",
    "AuthConfig.admin_keys": "admin API keys (/admin routes)",
    "AuthConfig.default_tpm": "tokens per minute for keys naming none",
    "AuthConfig.cache_ttl_s": "how long a Redis key lookup is cached",
    "AuthConfig.negative_cache_ttl_s": "how long an unknown key is remembered",
    "AuthConfig.cache_size": "key lookups cached",
    "GeoConfig.default_region": "region of clients that cannot be placed",
    "GeoConfig.mode": "auto: memory-map the database; memory: load it",
    "GeoConfig.cache_size": "IP lookups cached",
    "OpenAINodeConfig.id": "node id (metrics, /admin/nodes)",
    "OpenAINodeConfig.url": "its base URL (without /v1)",
    "OpenAINodeConfig.region": "where it runs",
    "OpenAINodeConfig.models": "model names it serves",
    "OpenAINodeConfig.max_context": "its context length (tokens)",
    "OpenAINodeConfig.device": "shown in /admin/nodes",
    "OpenAINodeConfig.ttl_s": "how long its advertised state stays fresh",
    "PolicyConfig.policy": "the routing policy (latency: predicted fastest node)",
    "RttOverride.a": "a region",
    "RttOverride.b": "the other region",
    "RttOverride.ms": "their RTT (ms)",
}


def describe(model: type[BaseModel], name: str, field: Any) -> str:
    return field.description or MEANINGS.get(f"{model.__name__}.{name}", "")


def _default(field: Any) -> Any:
    if field.default is not PydanticUndefined:
        return field.default
    if field.default_factory is not None:
        try:
            return field.default_factory()
        except TypeError:
            return None
    return PydanticUndefined


def _default_text(name: str, field: Any) -> str:
    if name == "node_token":
        return "`$EDGECLOUD_NODE_TOKEN`"
    d = _default(field)
    if d is PydanticUndefined:
        return "required"
    if isinstance(d, SecretStr):
        return '`""`' if not d.get_secret_value() else "(secret)"
    if isinstance(d, BaseModel):
        return "see below"
    if isinstance(d, Path):
        d = str(d)
    return f"`{json.dumps(d)}`"


def _bounds(field: Any) -> str:
    parts = []
    for m in field.metadata:
        for key, sym in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            v = getattr(m, key, None)
            if v is not None:
                parts.append(f"{sym} {v}")
    return f" ({', '.join(parts)})" if parts else ""


def model_section(model: type[BaseModel], path: str, seen: set[type[BaseModel]]) -> list[str]:
    lines = [f"### `{path}`", ""]
    doc = (model.__doc__ or "").strip()
    if doc and not doc.startswith("Example") and model.__module__ != "pydantic.main":
        lines += [doc.split("\n\n")[0].replace("\n", " "), ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    nested: list[tuple[type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        desc = describe(model, name, field).replace("|", "\\|").replace("\n", " ")
        for sub in _models_in(field.annotation):
            origin = typing.get_origin(field.annotation)
            suffix = "[]" if origin is list else ("{}" if origin is dict else "")
            nested.append((sub, f"{path}.{name}{suffix}"))
        lines.append(
            f"| `{name}` | {_type_name(field.annotation)}{_bounds(field)} | "
            f"{_default_text(name, field)} | {desc} |"
        )
    lines.append("")
    for sub, sub_path in nested:
        if sub in seen:
            continue
        seen.add(sub)
        lines += model_section(sub, sub_path, seen)
    return lines


def _parser_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) or a.help == argparse.SUPPRESS:
            continue
        if "-h" in a.option_strings:
            continue
        flag = ", ".join(a.option_strings) or a.dest
        if a.choices and not isinstance(a, argparse._SubParsersAction):
            flag += " {" + ",".join(map(str, a.choices)) + "}"
        d = a.default
        if d is argparse.SUPPRESS or d is None or (isinstance(d, bool) and not d):
            dtext = ""
        else:
            dtext = f"`{d}`"
        if not a.option_strings and a.nargs not in ("?", "*"):
            dtext = "required"
        help_text = (a.help or "").replace("|", "\\|").replace("%%", "%")
        rows.append(f"| `{flag}` | {dtext} | {help_text} |")
    return rows


def cli_section() -> list[str]:
    from gateway.cli import all_parsers

    lines = ["## Commands and flags", ""]
    lines += [
        "Every command also takes `-v/--verbose` (the libraries' own output during long steps) "
        "and `--debug` (tracebacks).",
        "",
    ]
    for p in all_parsers()[1:]:
        leaf = not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)
        if not leaf:
            continue
        lines += [f"### `{p.prog}`", ""]
        if p.description:
            lines += [" ".join(p.description.split()), ""]
        lines += [r for r in _parser_rows(p) if "--verbose" not in r and "--debug" not in r]
        lines.append("")
    return lines


def reference() -> str:
    from gateway.front.config import GatewayConfig
    from routing.policy_config import PolicyConfig

    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_reference.py from the settings models and the "
        "argument parsers; do not edit by hand (tests/test_config_reference.py checks it). -->",
        "",
        "Two YAML files configure a gateway: the **gateway YAML** (`edgecloud gateway --config "
        "FILE`: where the nodes are, keys, limits, geo) and the **policy YAML** (its "
        "`policy_file`, or `edgecloud serve --policy-file`: every routing knob, hot-reloaded). "
        "Unknown keys are errors. Examples: `examples/gateway.yaml`, `examples/policy.yaml`.",
        "",
        "## Gateway YAML (`GatewayConfig`)",
        "",
    ]
    out += model_section(GatewayConfig, "gateway", {GatewayConfig})
    out += ["## Policy YAML (`PolicyConfig`)", ""]
    out += model_section(PolicyConfig, "policy", {PolicyConfig})
    out += cli_section()
    return "\n".join(out).rstrip() + "\n"


def _yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return json.dumps(value)  # JSON scalars, lists and maps are YAML flow values


def _policy_lines(model: type[BaseModel], values: dict[str, Any], indent: int) -> list[str]:
    """``values`` (the defaults, as JSON) under ``model``'s field descriptions."""
    pad = " " * indent
    lines: list[str] = []
    for name, field in model.model_fields.items():
        desc = " ".join(describe(model, name, field).split())
        if typing.get_origin(field.annotation) is typing.Literal:
            desc += " One of: " + ", ".join(map(str, typing.get_args(field.annotation))) + "."
        desc = desc.strip()
        value = values[name]
        subs = _models_in(field.annotation)
        if subs and isinstance(value, dict) and typing.get_origin(field.annotation) is None:
            lines.append(f"{pad}{name}:" + (f"  # {desc}" if desc else ""))
            lines += _policy_lines(subs[0], value, indent + 2)
            continue
        lines.append(f"{pad}{name}: {_yaml_value(value)}" + (f"  # {desc}" if desc else ""))
    return lines


def policy_example() -> str:
    from routing.policy_config import PolicyConfig

    head = [
        "# The routing policy: every knob at its default, with its meaning (generated by",
        "# scripts/gen_config_reference.py; the reference is docs/configuration.md).",
        "# Load it with `policy_file: examples/policy.yaml` in the gateway YAML or",
        "# `edgecloud serve --policy-file examples/policy.yaml`; a running gateway re-reads it",
        "# when it changes (a bad edit is reported in /health and the previous one kept).",
        "",
    ]
    values = PolicyConfig().model_dump(mode="json")
    return "\n".join(head + _policy_lines(PolicyConfig, values, 0)) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args()
    wanted = {DOC: reference(), POLICY_EXAMPLE: policy_example()}
    stale = [p for p, text in wanted.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(REPO)} is stale: run python scripts/gen_config_reference.py")
        return 1 if stale else 0
    for p, text in wanted.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
