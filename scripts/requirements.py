"""Print pyproject.toml's requirements for some extras, one a line, for ``pip install -r``.

Usage: python scripts/requirements.py [--only NAME,...] EXTRA...
The core dependencies come first, then each extra's, with the project's own
extras (``edgecloud[models]``) expanded in place, so the list never names the project itself.
``--only`` keeps the requirements of those distribution names. Needs only the standard library.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def dist_name(requirement: str) -> str:
    """The distribution name a requirement line starts with, lower-cased."""
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip().lower()


def expand(project: dict, extras: list[str]) -> list[str]:
    """Core requirements and those of ``extras``, self-references expanded, each line once, in
    first-seen order."""
    name = project["name"].lower()
    table = project.get("optional-dependencies", {})
    out: list[str] = list(project["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for req in table[extra]:
            if dist_name(req) == name:
                todo.extend(x.strip() for x in req.split("[", 1)[1].split("]")[0].split(","))
            else:
                out.append(req)
    return list(dict.fromkeys(out))


def main(argv: list[str]) -> int:
    only: set[str] | None = None
    extras: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--only":
            only = {n.strip().lower() for n in next(args).split(",")}
        else:
            extras.append(arg)
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = expand(project, extras)
    if only is not None:
        reqs = [r for r in reqs if dist_name(r) in only]
    print("\n".join(reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
