"""Where models live on disk, and how a name or a folder path becomes a model.

Invariants:
- A model in the store is a folder ``<models_dir>/<name>`` in Hugging Face layout
  (config.json, *.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json).
  It appears there only complete: pulls write a temporary sibling folder and rename it.
- A model's *identity* is a short stable string that changes whenever its weights, config or
  tokenizer change; prefix block hashes and tokenizer caches are keyed by it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

DEFAULT_MODEL = "smollm2-135m-instruct"
MANIFEST = "edgecloud.json"  # written by imports: name, identity, source


class ModelNotFound(LookupError):
    pass


def home_dir() -> Path:
    """Root of edgecloud's cache (``$EDGECLOUD_HOME``, else the user's XDG cache dir)."""
    env = os.environ.get("EDGECLOUD_HOME")
    return Path(env) if env else Path(platformdirs.user_cache_dir("edgecloud"))


def models_dir() -> Path:
    return home_dir() / "models"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: Path
    identity: str
    size_bytes: int


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def model_identity(path: Path) -> str:
    """The identity recorded at import, else a digest of config, tokenizer and weight headers."""
    manifest = path / MANIFEST
    if manifest.is_file():
        ident = json.loads(manifest.read_text()).get("identity")
        if ident:
            return str(ident)
    h = hashlib.sha256()
    for fname in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        f = path / fname
        if f.is_file():
            h.update(fname.encode())
            h.update(f.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return f"{path.name}-{h.hexdigest()[:16]}"


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve(name_or_path: str | os.PathLike[str]) -> ModelInfo:
    """A store name (``smollm2-135m-instruct``) or a local HF folder path, as a ModelInfo."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not is_model_folder(p):
            raise ModelNotFound(
                f"{p} is not a Hugging Face model folder (config.json + *.safetensors)"
            )
        return ModelInfo(p.name, p.resolve(), model_identity(p), _folder_size(p))
    name = str(name_or_path)
    folder = models_dir() / name
    if not is_model_folder(folder):
        raise ModelNotFound(
            f"model {name!r} is not in the store; run: edgecloud models pull {name}"
        )
    return ModelInfo(name, folder, model_identity(folder), _folder_size(folder))


def list_models() -> list[ModelInfo]:
    root = models_dir()
    if not root.is_dir():
        return []
    return [
        ModelInfo(d.name, d, model_identity(d), _folder_size(d))
        for d in sorted(root.iterdir())
        if d.is_dir() and not d.name.startswith(".") and is_model_folder(d)
    ]
