"""The exceptions echo2 raises on purpose, each carrying one line a user can act on.

    Echo2Error                 base: `str(err)` is the one-line message the CLI prints
    ├── ConfigError            a setting is missing, out of range or inconsistent
    ├── ModelError             a model directory is missing or does not load
    ├── LearnerUnreachable     the worker cannot reach the learner's HTTP API
    ├── AuthError              the learner rejected our token (HTTP 401/403)
    │   └── SessionLost        the learner no longer knows this worker (it restarted): join again
    ├── ProtocolError          the other side answered with something we cannot use (4xx, bad body)
    │   └── LeaseLost          the learner refused to go on with a lease in progress (it expired): drop its work
    ├── BroadcastError         a policy version could not be created, fetched or verified
    └── DiskFullError          no space left for a checkpoint or a policy version

Lower-layer errors (httpx, OSError, libtorrent alerts) are mapped to these at the module boundary;
`cli.main` turns any of them into `echo2: error: <message>` and exit code 2, never a traceback.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator


class Echo2Error(Exception):
    """Base class: the message is what the user sees."""


class ConfigError(Echo2Error):
    pass


class ModelError(Echo2Error):
    pass


class LearnerUnreachable(Echo2Error):
    pass


class AuthError(Echo2Error):
    pass


class SessionLost(AuthError):
    pass


class ProtocolError(Echo2Error):
    pass


class LeaseLost(ProtocolError):
    pass


class BroadcastError(Echo2Error):
    pass


class DiskFullError(Echo2Error):
    pass


def is_disk_full(error: BaseException | str) -> bool:
    """ENOSPC from any layer: an OSError, another library's error wrapping one (safetensors, zstd, torch.save
    report it as their own), or libtorrent's error message."""
    return getattr(error, "errno", None) == errno.ENOSPC or "No space left" in str(error)


@contextlib.contextmanager
def disk_full_is_one_line(what: str) -> Iterator[None]:
    """A full disk while writing `what` → DiskFullError; any other error passes through."""
    try:
        yield
    except Exception as exc:
        if is_disk_full(exc):
            raise DiskFullError(f"disk full writing {what}: free space or move --out") from exc
        raise


def first_line(exc: BaseException) -> str:
    """The first line of another library's error message (its type's name if it has none), for a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
