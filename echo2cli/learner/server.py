"""The learner's HTTP API (`/v1/...`), tracker (`/announce`) and web seed (`/webseed`), as one FastAPI app.

Handlers are thin: they check credentials, validate the body with the shared `protocol` models and call
the `Coordinator`.

Credentials: joining needs the learner's join token (when it has one); the join returns the worker's own
session token, which every call made as that worker must carry (Bearer), and a tracker key, which the
worker's torrent client puts in its announce URL (`/announce/{key}`) and its web seed URL (`/webseed/{key}/`,
broadcast/webseed.py). Read-only calls (status, policy,
model files) take the join token or any live session token.
401 = wrong or missing token; 403 = a token for another worker, or a worker cut off for invalid data;
404 = unknown worker (join again); 409 = an episode step out of turn or for a lease that ended; 413 = a body
larger than this run ever needs; 422 = malformed body (every number is bounded: protocol.py); 429 = more web
seed streams than a worker (or the learner) may have open, or a join past the most workers a learner holds.
Credentials and body size are checked from the headers before any body is read (`guard.RequestGuard`);
the handlers then check that a session token belongs to the worker it speaks for. With a join token set,
/docs and /openapi.json need a token like every read-only call.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse

from echo2cli import __version__
from echo2cli.broadcast.tracker import Tracker, bencode, parse_announce
from echo2cli.broadcast.webseed import BusyError, RangeError, WebSeed
from echo2cli.errors import ConfigError
from echo2cli.learner.connections import Admission, http_protocol
from echo2cli.learner.coordinator import Coordinator
from echo2cli.learner.credentials import same_secret
from echo2cli.learner.episode_host import EpisodeHost, StepRefused
from echo2cli.learner.fleet import FleetFull
from echo2cli.learner.guard import SMALL_BODY, RequestGuard, rollout_body_limit
from echo2cli.protocol import (
    API,
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
    compatible,
)

JOIN_TOKEN_MISSING = (
    "wrong or missing join token: pass --token (or ECHO2_TOKEN, or --token-file) with the learner's secret"
)
SESSION_TOKEN_MISSING = "wrong or missing session token: use the one /v1/join returned (join again)"
READER_TOKEN_MISSING = "wrong or missing token: pass the learner's join token, or join again for a session token"


def build_app(
    coord: Coordinator,
    *,
    run_id: str,
    join_info: dict[str, Any],
    model_dir: Path,
    model_files: list[str],
    token: str | None,
    status_extra: Callable[[], dict[str, Any]],
    target_steps: int,
    web_seed: WebSeed | None = None,
    episodes: EpisodeHost | None = None,
) -> FastAPI:
    """`join_info`: the run's settings every JoinResponse carries; `status_extra()`: the newest metrics and
    recent history for /status (`Status.last_metrics`, `Status.history`); `episodes`: the environment the learner
    steps for a task with hidden state (episode_host.py)."""
    app = FastAPI(title="echo2 learner", version="1")
    app.state.coord = coord
    gate = Gate(coord, token)
    limits = {f"{API}/rollouts": rollout_body_limit(coord.B, coord.G, coord.max_new_tokens)}
    if episodes is not None:  # a lease's episodes, one action each
        limits[f"{API}/episodes/step"] = rollout_body_limit(coord.B, coord.G, episodes.turn_tokens)
    app.add_middleware(RequestGuard, authorize=gate.authorize, limit=lambda path: limits.get(path, SMALL_BODY))
    app.add_exception_handler(RequestValidationError, _invalid_body)  # type: ignore[arg-type]
    app.include_router(_worker_routes(coord, gate, run_id, join_info))
    app.include_router(_reader_routes(coord, gate, run_id, model_dir, model_files, status_extra, target_steps))
    app.include_router(_tracker_routes(coord))
    if web_seed is not None:
        app.include_router(_web_seed_routes(coord, web_seed))
    if episodes is not None:
        app.include_router(_episode_routes(gate, episodes))
    return app


def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Location and message only: FastAPI's default echoes the offending input back, and an input such as 1e400
    (inf) cannot be written as JSON, which turned a client's bad body into a 500."""
    errors = [
        {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
        for e in exc.errors()
    ]
    return JSONResponse({"detail": errors}, status_code=422)


def _bearer(authorization: str | None) -> str:
    return authorization[7:] if authorization and authorization.startswith("Bearer ") else ""


class Gate:
    """Who may call what: the join token (`token`, None = an open learner) and the workers' session tokens."""

    WORKER_PATHS = frozenset(
        {f"{API}/lease", f"{API}/rollouts", f"{API}/heartbeat", f"{API}/leave", f"{API}/episodes/step"}
    )

    def __init__(self, coord: Coordinator, token: str | None) -> None:
        self.coord, self.token = coord, token

    def is_join_token(self, presented: str) -> bool:
        return self.token is not None and same_secret(presented, self.token)

    def authorize(self, path: str, presented: str) -> tuple[int, str] | None:
        """From the Authorization header alone, before the body is read (the handlers check the rest)."""
        if path.startswith(("/announce", "/webseed/")):
            return None  # the tracker key in the path is the credential
        if path == f"{API}/join":
            return (401, JOIN_TOKEN_MISSING) if self.token is not None and not self.is_join_token(presented) else None
        if path in self.WORKER_PATHS:  # a session token, or the join token (an operator): the handler says who
            if self.coord.session_owner(presented) is not None or self.is_join_token(presented):
                return None
            if self.coord.cut_off_session(presented):
                return 403, f"this worker was cut off after {self.coord.max_bad_batches} batches of invalid rollouts"
            return 401, SESSION_TOKEN_MISSING
        if self.token is None or self.is_join_token(presented) or self.coord.session_owner(presented) is not None:
            return None  # read-only calls, /docs and /openapi.json
        return 401, READER_TOKEN_MISSING

    def join(self, authorization: str | None = Header(default=None)) -> None:
        """Joining needs the learner's join token, when it has one."""
        if self.token is not None and not self.is_join_token(_bearer(authorization)):
            raise HTTPException(401, JOIN_TOKEN_MISSING)

    def reader(self, authorization: str | None = Header(default=None)) -> None:
        """Read-only calls: the join token or any live session token."""
        presented = _bearer(authorization)
        if self.token is not None and not self.is_join_token(presented) and self.coord.session_owner(presented) is None:
            raise HTTPException(401, READER_TOKEN_MISSING)

    def worker(self, worker_id: str, authorization: str | None) -> None:
        """Calls made as a worker: its own session token (from join), and nobody else's."""
        if self.coord.cut_off(worker_id):
            raise HTTPException(
                403,
                f"worker {worker_id} was cut off after {self.coord.max_bad_batches} batches of invalid rollouts"
                " in a row",
            )
        if not self.coord.known(worker_id):
            raise HTTPException(404, f"unknown worker {worker_id}: join again")
        owner = self.coord.session_owner(_bearer(authorization))
        if owner is None:
            raise HTTPException(401, SESSION_TOKEN_MISSING)
        if owner != worker_id:
            raise HTTPException(403, f"this session token belongs to another worker, not {worker_id}")


def _worker_routes(coord: Coordinator, gate: Gate, run_id: str, join_info: dict[str, Any]) -> APIRouter:
    router = APIRouter(prefix=API)

    @router.post("/join", dependencies=[Depends(gate.join)])
    def join(req: JoinRequest, request: Request) -> JoinResponse:
        if not compatible(req.echo2_version, __version__):
            raise HTTPException(
                409,
                f"worker runs echo2 {req.echo2_version or '(unknown)'}, the learner {__version__}: install the "
                "same version on both",
            )
        try:
            address = request.client.host if request.client is not None else None
            worker_id = coord.join(req.name, req.usd_per_hour, req.max_model_len, address)
        except FleetFull as exc:
            raise HTTPException(429, str(exc)) from None
        session_token, tracker_key = coord.secrets_of(worker_id)
        return JoinResponse(
            worker_id=worker_id,
            session_token=session_token,
            tracker_key=tracker_key,
            run_id=run_id,
            policy=coord.latest_policy(worker_id),
            **join_info,
        )

    @router.post("/lease")
    def lease(req: LeaseRequest, authorization: str | None = Header(default=None)) -> LeaseResponse:
        gate.worker(req.worker_id, authorization)
        return coord.lease(req.worker_id, req.version, req.max_prompts)

    @router.post("/rollouts")
    def rollouts(batch: RolloutBatch, authorization: str | None = Header(default=None)) -> SubmitResult:
        gate.worker(batch.worker_id, authorization)
        if len(batch.samples) > coord.B * coord.G:  # a lease holds at most B prompts of G samples each
            raise HTTPException(422, f"a batch holds at most B x G = {coord.B * coord.G} samples")
        return coord.submit(batch)

    @router.post("/heartbeat")
    def heartbeat(hb: Heartbeat, authorization: str | None = Header(default=None)) -> HeartbeatReply:
        gate.worker(hb.worker_id, authorization)
        coord.heartbeat(hb)
        return HeartbeatReply(latest_version=coord.latest_policy().version, finished=coord.finished)

    @router.post("/leave")
    def leave(req: LeaveRequest, authorization: str | None = Header(default=None)) -> dict[str, int]:
        gate.worker(req.worker_id, authorization)
        return {"returned_prompts": coord.leave(req.worker_id)}

    return router


def _episode_routes(gate: Gate, host: EpisodeHost) -> APIRouter:
    router = APIRouter(prefix=API)

    @router.post("/episodes/step")
    def step(req: StepRequest, authorization: str | None = Header(default=None)) -> StepReply:
        """The next observation of each of the worker's episodes, for a task whose environment hides state."""
        gate.worker(req.worker_id, authorization)
        try:
            return StepReply(steps=host.step(req.worker_id, req.lease_id, req.actions))
        except StepRefused as exc:
            raise HTTPException(exc.status, str(exc)) from None

    return router


def _reader_routes(
    coord: Coordinator,
    gate: Gate,
    run_id: str,
    model_dir: Path,
    model_files: list[str],
    status_extra: Callable[[], dict[str, Any]],
    target_steps: int,
) -> APIRouter:
    router = APIRouter(prefix=API, dependencies=[Depends(gate.reader)])

    @router.get("/model/files/{name}")
    def model_file(name: str) -> FileResponse:
        if name not in model_files:
            raise HTTPException(404, f"no model file {name!r}")
        return FileResponse(model_dir / name)

    @router.get("/policy")
    def policy(
        worker_id: str | None = None, version: int | None = None, authorization: str | None = Header(default=None)
    ) -> PolicyInfo:
        """The newest version, or `version` (a link of a delta chain). `worker_id`: the caller, recorded as fetching
        it (and handed its fetch slot) only when the session token presented is that worker's: anyone else's call
        gets the version alone and changes no worker's record."""
        if worker_id is not None and coord.session_owner(_bearer(authorization)) != worker_id:
            worker_id = None
        if version is None:
            return coord.latest_policy(worker_id)
        found = coord.policy_of(version, worker_id)
        if found is None:
            raise HTTPException(404, f"version {version} was never published")
        return found

    @router.get("/status")
    def status() -> Status:
        return Status(
            run_id=run_id,
            step=coord.version,
            target_steps=target_steps,
            version=coord.latest_policy().version,
            finished=coord.finished,
            workers=coord.worker_views(),
            rejected=coord.rejected_samples(),
            **status_extra(),
        )

    return router


def _tracker_routes(coord: Coordinator) -> APIRouter:
    router = APIRouter()
    tracker, lock = Tracker(), threading.Lock()

    @router.get("/announce/{key}")
    def announce(key: str, request: Request) -> Response:
        """The tracker serves only the learner's node and joined workers, each announcing with its key."""
        if not coord.tracker_key_ok(key):
            failure = bencode({"failure reason": "not a joined peer: join the learner first"})
            return Response(failure, media_type="text/plain")
        query = parse_announce(request.scope.get("query_string", b""))
        remote = request.client.host if request.client else "127.0.0.1"
        with lock:
            body = tracker.announce(query, remote)
        return Response(body, media_type="text/plain")

    return router


def _web_seed_routes(coord: Coordinator, web_seed: WebSeed) -> APIRouter:
    router = APIRouter()

    @router.get("/webseed/{key}/{dir_name}/{file_name}")
    async def serve(
        key: str,
        dir_name: str,
        file_name: str,
        request: Request,
        range: str | None = Header(default=None),  # noqa: A002
    ) -> Response:
        """BEP 19 for joined workers: byte ranges of the versions the learner seeds (broadcast/webseed.py).

        `async`, and the coordinator's lock taken on the web seed's own threads: a stream, slow by design, must
        never hold one of the threads the API's sync handlers (heartbeat, lease, ...) run on."""
        if not await web_seed.in_lane(coord.tracker_key_ok, key):
            raise HTTPException(401, "not a joined peer: join the learner first")
        try:
            address = request.client.host if request.client is not None else None
            stream = await web_seed.stream(key, dir_name, file_name, range, address)
        except BusyError as exc:
            raise HTTPException(429, str(exc)) from None
        except RangeError as exc:
            raise HTTPException(416, str(exc)) from None
        if stream is None:
            raise HTTPException(404, f"{dir_name}/{file_name} is not a version this learner seeds now")
        return stream

    return router


def bind_socket(host: str, port: int) -> socket.socket:
    """Bound before anything slow starts, so a busy port fails in one line at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port") from exc
    sock.listen(128)
    return sock


# Open connections (and requests in flight) uvicorn serves at once; past it, it answers 503, which a worker's client
# retries, instead of failing accept() once fds run out. ~1,000 workers with an API connection and a web seed or
# tracker connection each; never more than half the fds, the rest being libtorrent's peers and the files it seeds.
MAX_CONNECTIONS = 2048
# A peer that has taken no byte for this long is gone or hostile: the kernel drops the connection (TCP_USER_TIMEOUT,
# Linux). Without it a web seed reader that never reads keeps its socket (and a connection) after its stream is cut
# (webseed.SEND_TIMEOUT_S), since closing waits for the unsent bytes. Twice the longest request timeout of a worker.
STALLED_PEER_S = 60


def raise_fd_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit (every connection, seeded file and peer is an fd, and the
    usual soft limit of 1024 ran out first); returns the soft limit in force. Unprivileged and process-wide."""
    try:
        import resource
    except ImportError:  # not a POSIX system: leave it
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 16  # macOS: an "unlimited" hard limit setrlimit refuses
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 16


def serve_in_thread(
    app: Any, sock: socket.socket, tls: tuple[Path, Path] | None = None, admission: Admission | None = None
) -> tuple[Any, threading.Thread]:
    """uvicorn on `sock` in a daemon thread, once it accepts requests; stop it with `server.should_exit = True`.
    `admission`: the per-address and request-header limits on its connections (`connections.py`; the defaults
    if None)."""
    import uvicorn

    cert, key = tls or (None, None)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # accepted connections inherit it from the listening socket
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, STALLED_PEER_S * 1000)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=30,
        ssl_certfile=cert,
        ssl_keyfile=key,
        limit_concurrency=min(MAX_CONNECTIONS, raise_fd_limit() // 2),
        http=http_protocol(admission or Admission()),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="http")
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    return server, thread


@contextlib.contextmanager
def serving(
    app: Any, sock: socket.socket, tls: tuple[Path, Path] | None = None, admission: Admission | None = None
) -> Iterator[None]:
    server, thread = serve_in_thread(app, sock, tls, admission)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)
