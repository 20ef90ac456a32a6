"""TLS between gateways and nodes: one folder of PEM files per process, read the same way on
both sides.

A folder holds ``cert.pem`` (this process's certificate chain, leaf first), ``key.pem`` (its
private key) and ``ca.pem`` (the CA bundle this process trusts for its peer):

- a **node** (``$EDGECLOUD_NODE_TLS``) serves HTTPS with ``cert.pem``/``key.pem`` (both
  required); with ``ca.pem`` it also requires every client to present a certificate that CA
  signed (mutual TLS);
- a **gateway** (``node_tls`` in its YAML) verifies nodes' certificates against ``ca.pem``
  (without it, against the system's trust store) and, with ``cert.pem``/``key.pem``, presents
  that certificate to nodes that ask for one.

Invariants: a folder is checked when it is loaded (:func:`load_tls_folder`): the files named
exist, the certificate and key load and match, the CA bundle parses; any failure is a
:class:`TLSFolderError` naming the folder and the file, never a key's contents. A client
context always verifies the peer's certificate and host name (there is no setting to turn that
off). Imports only the standard library.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CERT, KEY, CA = "cert.pem", "key.pem", "ca.pem"

NODE_TLS_ENV = "EDGECLOUD_NODE_TLS"


class TLSFolderError(ValueError):
    """A TLS folder that cannot be used (missing file, unreadable or mismatched PEM)."""


@dataclass(frozen=True)
class TLSFolder:
    """The PEM files found in one folder (None: absent)."""

    folder: Path
    cert: Path | None
    key: Path | None
    ca: Path | None

    @property
    def mutual(self) -> bool:
        """A node with a CA bundle requires client certificates."""
        return self.ca is not None

    def server_options(self) -> dict[str, Any]:
        """uvicorn's ``Config`` keyword arguments that serve HTTPS with this folder (client
        certificates required when it has ``ca.pem``)."""
        if self.cert is None or self.key is None:
            raise TLSFolderError(f"TLS folder {self.folder}: a node needs {CERT} and {KEY}")
        options: dict[str, Any] = {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}
        if self.ca is not None:
            options["ssl_ca_certs"] = str(self.ca)
            options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        return options


def client_context(folder: TLSFolder | None) -> ssl.SSLContext:
    """The context a gateway reaches ``https://`` nodes with: peer certificate and host name
    verified against ``folder``'s CA (the system's trust store without one), its client
    certificate presented when it has one."""
    cafile = str(folder.ca) if folder is not None and folder.ca is not None else None
    try:
        ctx = ssl.create_default_context(cafile=cafile)
        if folder is not None and folder.cert is not None and folder.key is not None:
            ctx.load_cert_chain(str(folder.cert), str(folder.key))
    except (ssl.SSLError, OSError) as exc:
        where = folder.folder if folder is not None else "the system trust store"
        raise TLSFolderError(f"TLS folder {where}: {_why(exc)}") from None
    return ctx


def _why(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None)
    return str(reason or type(exc).__name__).replace("_", " ").lower()


def load_tls_folder(folder: str | Path, *, server: bool) -> TLSFolder:
    """The folder's PEM files, checked (see the module's invariants). ``server``: a node's
    folder, which must hold ``cert.pem`` and ``key.pem``; a gateway's may hold either the pair
    or ``ca.pem`` or both (one of them)."""
    path = Path(folder)
    if not path.is_dir():
        raise TLSFolderError(f"TLS folder {path}: not a folder")
    found = {name: (path / name) if (path / name).is_file() else None for name in (CERT, KEY, CA)}
    cert, key, ca = found[CERT], found[KEY], found[CA]
    if (cert is None) != (key is None):
        missing = CERT if cert is None else KEY
        raise TLSFolderError(f"TLS folder {path}: {missing} is missing (cert and key go together)")
    if server and cert is None:
        raise TLSFolderError(f"TLS folder {path}: a node needs {CERT} and {KEY}")
    if cert is None and ca is None:
        raise TLSFolderError(f"TLS folder {path}: none of {CERT}, {KEY}, {CA}")
    tls = TLSFolder(path, cert, key, ca)
    _check(tls)
    return tls


def _check(tls: TLSFolder) -> None:
    """Load every file once, as the server or client would, so a bad one fails at start."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if tls.cert is not None and tls.key is not None:
        try:
            ctx.load_cert_chain(str(tls.cert), str(tls.key))
        except (ssl.SSLError, OSError) as exc:
            raise TLSFolderError(
                f"TLS folder {tls.folder}: {CERT} and {KEY} do not load as a matching "
                f"certificate and key ({_why(exc)})"
            ) from None
    if tls.ca is not None:
        try:
            ctx.load_verify_locations(cafile=str(tls.ca))
        except (ssl.SSLError, OSError) as exc:
            raise TLSFolderError(
                f"TLS folder {tls.folder}: {CA} is not a PEM CA bundle ({_why(exc)})"
            ) from None
