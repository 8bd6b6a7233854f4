"""TLS for the learner's API and tracker, from a certificate and key the operator provides.

    learner:  --tls-cert cert.pem --tls-key key.pem    serves https:// (API, model files, tracker)
    worker:   --join https://... [--ca-cert cert.pem]   verifies the learner (system CAs + --ca-cert)

Two clients verify the learner: httpx (the API) and libtorrent (tracker announces). libtorrent verifies
HTTPS trackers with OpenSSL's default paths, which honour `SSL_CERT_FILE`, so each process points that
variable at one bundle: the system CAs plus the operator's certificate. A self-signed certificate then
works as its own CA, and a CA-signed one verifies as usual.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from echo2cli.errors import ConfigError


def check_server_files(cert: Path, key: Path) -> None:
    """Fail at start, in one line, if the pair cannot serve TLS."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(cert), str(key))
    except FileNotFoundError as exc:
        raise ConfigError(f"TLS file not found: {exc.filename}") from exc
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"cannot serve TLS with --tls-cert {cert} and --tls-key {key}: {exc}") from exc


def client_context(ca_cert: Path | None) -> ssl.SSLContext:
    """System CAs, plus `ca_cert` (a private CA, or the learner's self-signed certificate)."""
    ctx = ssl.create_default_context(cafile=_system_bundle())
    if ca_cert is not None:
        try:
            ctx.load_verify_locations(cafile=str(ca_cert))
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"cannot read --ca-cert {ca_cert}: {exc}") from exc
    return ctx


def trust_for_torrents(extra: Path | None, directory: Path) -> None:
    """Make libtorrent in this process trust the system CAs plus `extra` (see the module docstring)."""
    if extra is None:
        return
    bundle = directory / "tls-trust.pem"
    directory.mkdir(parents=True, exist_ok=True)
    found = _system_bundle()
    system = Path(found).read_text() if found else ""
    bundle.write_text(system + "\n" + Path(extra).read_text())
    os.environ["SSL_CERT_FILE"] = str(bundle)


def _system_bundle() -> str | None:
    path = ssl.get_default_verify_paths().cafile
    if path and Path(path).exists():
        return path
    try:
        import certifi  # shipped with httpx

        return certifi.where()
    except ImportError:
        return None
