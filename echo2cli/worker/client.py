"""HTTP client for the learner's `/v1` API, typed with the shared `protocol` models.

Timeouts: `connect` 5 s (a learner that does not accept within 5 s is down or unreachable);
`read` = request_timeout_s (a submit carries a few hundred KB and the learner may be mid-step).
Retries: only what can succeed on retry — transport errors and 5xx — with exponential backoff, until the
learner has been unreachable for `unreachable_s`. 4xx are never retried: 401 → AuthError,
other 4xx → ProtocolError carrying the learner's detail. Once joined, a 401 or 404 ("unknown worker") means
the learner restarted and forgot our session: SessionLost, and the worker joins again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from echo2cli import __version__
from echo2cli.errors import AuthError, LearnerUnreachable, ProtocolError, SessionLost
from echo2cli.protocol import (
    API,
    MAX_MODEL_FILE_BYTES,
    Heartbeat,
    HeartbeatReply,
    JoinRequest,
    JoinResponse,
    LeaseRequest,
    LeaseResponse,
    LeaveRequest,
    PolicyInfo,
    RolloutBatch,
    Status,
    StepReply,
    StepRequest,
    SubmitResult,
)
from echo2cli.tls import client_context

M = TypeVar("M", bound=BaseModel)


class LearnerClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        request_timeout_s: float = 30.0,
        unreachable_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        ca_cert: Path | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.join_token = token
        self.joined = False
        self.url = url.rstrip("/")
        self.unreachable_s = unreachable_s
        self.http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=5.0),
            transport=transport,
            verify=client_context(ca_cert),
        )

    def _request(
        self, method: str, path: str, body: BaseModel | None = None, patience_s: float | None = None
    ) -> httpx.Response:
        patience_s = self.unreachable_s if patience_s is None else patience_s
        deadline = time.monotonic() + patience_s
        delay = 0.25
        while True:
            try:
                resp = self.http.request(
                    method,
                    path,
                    content=body.model_dump_json() if body else None,
                    headers={"Content-Type": "application/json"} if body else None,
                )
                if resp.status_code < 500:
                    break
                problem = f"HTTP {resp.status_code}"
            except httpx.TransportError as exc:
                if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                    raise LearnerUnreachable(
                        f"cannot verify the TLS certificate of {self.url}: pass --ca-cert with the learner's "
                        "certificate (or the CA that signed it)"
                    ) from exc
                problem = type(exc).__name__
                if self.url.startswith("http://") and isinstance(exc, httpx.RemoteProtocolError):
                    problem += "; if the learner serves TLS, the URL starts with https://"
            if time.monotonic() + delay > deadline:
                raise LearnerUnreachable(
                    f"learner at {self.url} unreachable for {patience_s:.0f} s ({problem}): "
                    "check the URL and that `echo2 learner` is running"
                )
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
        if self.joined and resp.status_code in (401, 404) and "join again" in _detail(resp):
            raise SessionLost(f"learner at {self.url} no longer knows this worker (restarted?): {_detail(resp)}")
        if resp.status_code == 401:
            raise AuthError(f"learner at {self.url} refused our token: pass the learner's --token")
        if resp.status_code == 403:
            raise AuthError(f"learner at {self.url} refused us: {_detail(resp)}")
        if resp.status_code == 409:
            raise ProtocolError(f"learner at {self.url} refused us: {_detail(resp)}")
        if resp.status_code >= 400:
            raise ProtocolError(f"learner answered {resp.status_code} to {method} {path}: {_detail(resp)}")
        return resp

    def _call(self, method: str, path: str, body: BaseModel | None, out: type[M]) -> M:
        resp = self._request(method, f"{API}{path}", body)
        try:
            return out.model_validate_json(resp.content)
        except ValueError as exc:
            raise ProtocolError(f"unexpected answer from {path}: {exc}") from exc

    def join(self, req: JoinRequest) -> JoinResponse:
        """Join with the learner's join token; every later call carries the session token this returns."""
        if not req.echo2_version:
            req = req.model_copy(update={"echo2_version": __version__})
        self.joined = False
        if self.join_token:
            self.http.headers["Authorization"] = f"Bearer {self.join_token}"
        else:
            self.http.headers.pop("Authorization", None)
        info = self._call("POST", "/join", req, JoinResponse)
        self.http.headers["Authorization"] = f"Bearer {info.session_token}"
        self.joined = True
        return info

    def lease(self, req: LeaseRequest) -> LeaseResponse:
        return self._call("POST", "/lease", req, LeaseResponse)

    def submit(self, batch: RolloutBatch) -> SubmitResult:
        return self._call("POST", "/rollouts", batch, SubmitResult)

    def step_episodes(self, req: StepRequest) -> StepReply:
        """The next observation of each episode the learner steps (a task with hidden state)."""
        return self._call("POST", "/episodes/step", req, StepReply)

    def heartbeat(self, hb: Heartbeat) -> HeartbeatReply:
        return self._call("POST", "/heartbeat", hb, HeartbeatReply)

    def policy(self, worker_id: str = "", version: int | None = None) -> PolicyInfo:
        """The newest version, or `version`."""
        params = ([f"worker_id={quote(worker_id)}"] if worker_id else []) + (
            [f"version={version}"] if version is not None else []
        )
        query = f"?{'&'.join(params)}" if params else ""
        return self._call("GET", f"/policy{query}", None, PolicyInfo)

    def status(self) -> Status:
        return self._call("GET", "/status", None, Status)

    def leave(self, worker_id: str) -> None:
        """Best effort and quick: on shutdown a gone learner must not hold us for unreachable_s."""
        self._request("POST", f"{API}/leave", LeaveRequest(worker_id=worker_id), patience_s=2.0)

    def model_file(self, name: str) -> bytes:
        """A config/tokenizer file, read up to MAX_MODEL_FILE_BYTES: a learner cannot fill our memory."""
        url = f"{API}/model/files/{quote(name)}"
        try:
            with self.http.stream("GET", url) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise ProtocolError(f"learner answered {resp.status_code} to GET {url}: {_detail(resp)}")
                return _read_capped(resp, name, self.url)
        except httpx.TransportError as exc:
            raise LearnerUnreachable(f"learner at {self.url} failed while sending {name}: {exc}") from exc

    def close(self) -> None:
        self.http.close()


def _read_capped(resp: httpx.Response, name: str, url: str) -> bytes:
    body = bytearray()
    for chunk in resp.iter_bytes():
        body += chunk
        if len(body) > MAX_MODEL_FILE_BYTES:
            raise ProtocolError(f"model file {name} from {url} exceeds {MAX_MODEL_FILE_BYTES >> 20} MiB: refusing it")
    return bytes(body)


def _detail(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("detail", resp.text))
    except (ValueError, AttributeError):
        return resp.text
