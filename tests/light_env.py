"""Run the ``edgecloud`` CLI as if only the core install (the gateway) were installed.

``python -m tests.light_env MODULES_FILE ARGS...`` computes the distributions the core install
pulls in (pyproject.toml's core list, then each installed distribution's own requirements), and
wraps every finder on ``sys.meta_path`` so that a module of any other installed distribution
(torch, onnxruntime, the extras', the test tools') and the engine packages are not found:
``find_spec`` gives None and ``import`` raises ModuleNotFoundError, as on a machine without them,
and importlib.metadata does not list them. It then runs ``gateway.cli.main(ARGS)`` and at exit
writes the top-level names of every module it loaded to MODULES_FILE (JSON). Invariant: no
module outside the core install is imported in this process after :func:`hide`.
"""

from __future__ import annotations

import atexit
import importlib.abc
import json
import sys
import tomllib
from collections.abc import Iterator, Sequence
from importlib import metadata
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
ENGINES = frozenset({"cloud_engine", "edge_runtime"})  # the project's own, beyond the gateway
VENV_BASE = frozenset({"pip", "setuptools", "wheel"})  # in every virtualenv


def norm(name: str) -> str:
    return name.lower().replace("_", "-")


def core_closure() -> set[str]:
    """Normalized names of the distributions the core install pulls in, markers evaluated
    with the extras each requirement asks for."""
    core = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    seen: set[str] = set()
    todo = [Requirement(r) for r in core]
    while todo:
        req = todo.pop()
        key = f"{norm(req.name)}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed: for another platform or Python
        for text in requires:
            sub = Requirement(text)
            envs = [{"extra": e} for e in (*req.extras, "")]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append(sub)
    return {k.partition("[")[0] for k in seen} | VENV_BASE


def hidden_modules(closure: set[str]) -> frozenset[str]:
    """Top-level modules of installed distributions outside ``closure``, and the engines."""
    out = set(ENGINES)
    for module, owners in metadata.packages_distributions().items():
        if not {norm(o) for o in owners} & closure:
            out.add(module)
    return frozenset(out - {"gateway", "routing", "tests"})


class Hiding(importlib.abc.MetaPathFinder):
    """A meta-path finder that answers None for hidden names and defers to ``inner`` else; it
    lists ``inner``'s distributions less those outside the closure."""

    def __init__(
        self, inner: importlib.abc.MetaPathFinder, hidden: frozenset[str], closure: set[str]
    ) -> None:
        self.inner, self.hidden, self.closure = inner, hidden, closure

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname.partition(".")[0] in self.hidden:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(fullname, path, target) if find is not None else None

    def find_distributions(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        find = getattr(self.inner, "find_distributions", None)
        for dist in find(*args, **kwargs) if find is not None else ():
            if norm(dist.metadata["Name"]) in self.closure | {"edgecloud"}:
                yield dist

    def invalidate_caches(self) -> None:
        invalidate = getattr(self.inner, "invalidate_caches", None)
        if invalidate is not None:
            invalidate()


def hide() -> frozenset[str]:
    """Wrap every finder on ``sys.meta_path``; return the hidden names. Refuses if one of them
    is already loaded."""
    closure = core_closure()
    hidden = hidden_modules(closure)
    loaded = hidden & {name.partition(".")[0] for name in sys.modules}
    if loaded:
        raise RuntimeError(f"already imported: {sorted(loaded)}")
    sys.meta_path[:] = [Hiding(f, hidden, closure) for f in sys.meta_path]
    return hidden


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    hidden = hide()

    def dump() -> None:
        loaded = sorted({n.partition(".")[0] for n in sys.modules})
        out.write_text(json.dumps({"loaded": loaded, "hidden": sorted(hidden)}))

    atexit.register(dump)
    from gateway.cli import main as cli_main

    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
