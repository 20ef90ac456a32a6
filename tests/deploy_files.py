"""What the tests of deploy/ share: the chart rendered offline by helm's own library, the
example values merged as helm merges them, the repository's deploy/ paths."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from tests.nodes import REPO

DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "edgecloud"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``, maps key by key, as helm merges values files."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def example_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def render(values: dict[str, Any], namespace: str = "llm") -> list[dict[str, Any]]:
    """The chart's objects for ``values`` (helm's render engine, offline); raises the
    library's HelmError when a template fails."""
    import helm_python as helm

    chart = helm.Chart.load(str(CHART))
    files = chart.render(values, name="ec", namespace=namespace, is_install=True)
    objects = []
    for name, text in files.items():
        if name.endswith(".txt"):
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]
