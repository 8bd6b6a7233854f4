"""The secrets the coordinator issues, and the constant-time checks on them.

The learner's join token (an operator's secret) is checked by the server. A worker that joins gets two
secrets of its own: a session token, which every call it makes as that worker must carry, and a tracker
key, which its torrent client puts in its announce URL. Both stop working when it leaves or is cut off;
a cut-off worker's token is remembered so that it hears why (403) rather than "join again".
"""

from __future__ import annotations

import secrets


def same_secret(a: str, b: str) -> bool:
    """Constant-time comparison that takes any text (a client may send non-ASCII)."""
    return secrets.compare_digest(a.encode(), b.encode())


class Credentials:
    def __init__(self) -> None:
        self.learner_tracker_key = secrets.token_hex(16)  # the learner's own node announces with it
        self._session: dict[str, str] = {}  # worker id -> session token, live workers only
        self._tracker: dict[str, str] = {}  # worker id -> tracker key, live workers only
        self._cut_off: list[str] = []  # session tokens of workers cut off for invalid data

    def issue(self, worker_id: str) -> tuple[str, str]:
        """(session token, tracker key) of a worker that has just joined."""
        self._session[worker_id] = secrets.token_urlsafe(24)
        self._tracker[worker_id] = secrets.token_hex(16)
        return self._session[worker_id], self._tracker[worker_id]

    def revoke(self, worker_id: str, *, cut_off: bool = False) -> None:
        token = self._session.pop(worker_id, None)
        self._tracker.pop(worker_id, None)
        if cut_off and token is not None:
            self._cut_off.append(token)

    def owner(self, token: str) -> str | None:
        """The live worker a session token belongs to."""
        return next((wid for wid, t in self._session.items() if same_secret(t, token)), None)

    def is_cut_off(self, token: str) -> bool:
        return any(same_secret(t, token) for t in self._cut_off)

    def session(self, worker_id: str) -> str:
        return self._session[worker_id]

    def tracker_key(self, worker_id: str) -> str:
        return self._tracker[worker_id]

    def tracker_key_ok(self, key: str) -> bool:
        """The tracker serves the learner's own node and workers that joined and have not left."""
        return same_secret(key, self.learner_tracker_key) or any(same_secret(k, key) for k in self._tracker.values())
