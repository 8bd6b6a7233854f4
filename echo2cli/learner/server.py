"""The learner's HTTP API (`/v1/...`) and BitTorrent tracker (`/announce`), as one FastAPI app.

Handlers are thin: they check credentials, validate the body with the shared `protocol` models and call
the `Coordinator`.

Credentials: joining needs the learner's join token (when it has one); the join returns the worker's own
session token, which every call made as that worker must carry (Bearer), and a tracker key, which the
worker's torrent client puts in its announce URL (`/announce/{key}`). Read-only calls (status, policy,
model files) take the join token or any live session token.
401 = wrong or missing token; 403 = a token for another worker, or a worker cut off for invalid data;
404 = unknown worker (join again); 413 = a body larger than this run ever needs; 422 = malformed body.
Credentials and body size are checked from the headers before any body is read (`guard.RequestGuard`);
the handlers then check that a session token belongs to the worker it speaks for. With a join token set,
/docs and /openapi.json need a token like every read-only call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse

from echo2cli import __version__
from echo2cli.broadcast.tracker import Tracker, bencode, parse_announce
from echo2cli.learner.coordinator import Coordinator, same_secret
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
    join_info: dict,
    model_dir: Path,
    model_files: list[str],
    token: str | None,
    status_extra: Callable[[], dict],
    target_steps: int,
) -> FastAPI:
    app = FastAPI(title="echo2 learner", version="1")
    app.state.coord = coord
    worker_paths = {f"{API}/lease", f"{API}/rollouts", f"{API}/heartbeat", f"{API}/leave"}
    rollouts_limit = rollout_body_limit(coord.B, coord.G, coord.max_new_tokens)

    def authorize(path: str, presented: str) -> tuple[int, str] | None:
        """From the Authorization header alone, before the body is read (the handlers check the rest)."""
        if path.startswith("/announce"):
            return None  # the tracker key in the path is the credential
        if path == f"{API}/join":
            if token is not None and not same_secret(presented, token):
                return 401, JOIN_TOKEN_MISSING
            return None
        if path in worker_paths:  # a session token, or the join token (an operator): the handler says which worker
            if coord.session_owner(presented) is not None or (token is not None and same_secret(presented, token)):
                return None
            if coord.cut_off_session(presented):
                return 403, f"this worker was cut off after {coord.max_bad_batches} batches of invalid rollouts"
            return 401, SESSION_TOKEN_MISSING
        if token is None or same_secret(presented, token) or coord.session_owner(presented) is not None:
            return None  # read-only calls, /docs and /openapi.json
        return 401, READER_TOKEN_MISSING

    app.add_middleware(
        RequestGuard,
        authorize=authorize,
        limit=lambda path: rollouts_limit if path == f"{API}/rollouts" else SMALL_BODY,
    )

    @app.exception_handler(RequestValidationError)
    def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes the offending input back, and an input such as 1e400 (inf) cannot be
        # written as JSON: that turned a client's bad body into a 500. Send location and message only.
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)

    tracker = Tracker()
    tracker_lock = threading.Lock()

    def bearer(authorization: str | None) -> str:
        return authorization[7:] if authorization and authorization.startswith("Bearer ") else ""

    def join_auth(authorization: str | None = Header(default=None)) -> None:
        """Joining needs the learner's shared join token, when it has one."""
        if token is not None and not same_secret(bearer(authorization), token):
            raise HTTPException(401, JOIN_TOKEN_MISSING)

    def reader_auth(authorization: str | None = Header(default=None)) -> None:
        """Read-only calls: the join token or any live session token."""
        presented = bearer(authorization)
        if token is not None and same_secret(presented, token):
            return
        if token is not None and coord.session_owner(presented) is None:
            raise HTTPException(401, READER_TOKEN_MISSING)

    def worker_auth(worker_id: str, authorization: str | None) -> None:
        """Calls made as a worker: its own session token (from join), and nobody else's."""
        if coord.cut_off(worker_id):
            raise HTTPException(
                403,
                f"worker {worker_id} was cut off after {coord.max_bad_batches} batches of invalid rollouts in a row",
            )
        if not coord.known(worker_id):
            raise HTTPException(404, f"unknown worker {worker_id}: join again")
        owner = coord.session_owner(bearer(authorization))
        if owner is None:
            raise HTTPException(401, SESSION_TOKEN_MISSING)
        if owner != worker_id:
            raise HTTPException(403, f"this session token belongs to another worker, not {worker_id}")

    @app.post(f"{API}/join", dependencies=[Depends(join_auth)])
    def join(req: JoinRequest) -> JoinResponse:
        if not compatible(req.echo2_version, __version__):
            raise HTTPException(
                409,
                f"worker runs echo2 {req.echo2_version or '(unknown)'}, the learner "
                f"{__version__}: install the same version on both",
            )
        worker_id = coord.join(req.name, req.usd_per_hour, req.max_model_len)
        w = coord.workers[worker_id]
        return JoinResponse(
            worker_id=worker_id,
            session_token=w.session_token,
            tracker_key=w.tracker_key,
            run_id=run_id,
            policy=coord.latest_policy(worker_id),
            **join_info,
        )

    @app.get(f"{API}/model/files/{{name}}", dependencies=[Depends(reader_auth)])
    def model_file(name: str) -> FileResponse:
        if name not in model_files:
            raise HTTPException(404, f"no model file {name!r}")
        return FileResponse(model_dir / name)

    @app.post(f"{API}/lease")
    def lease(req: LeaseRequest, authorization: str | None = Header(default=None)) -> LeaseResponse:
        worker_auth(req.worker_id, authorization)
        return coord.lease(req.worker_id, req.version, req.max_prompts)

    @app.post(f"{API}/rollouts")
    def rollouts(batch: RolloutBatch, authorization: str | None = Header(default=None)) -> SubmitResult:
        worker_auth(batch.worker_id, authorization)
        if len(batch.samples) > coord.B * coord.G:  # a lease holds at most B prompts of G samples each
            raise HTTPException(422, f"a batch holds at most B x G = {coord.B * coord.G} samples")
        return coord.submit(batch)

    @app.post(f"{API}/heartbeat")
    def heartbeat(hb: Heartbeat, authorization: str | None = Header(default=None)) -> HeartbeatReply:
        worker_auth(hb.worker_id, authorization)
        coord.heartbeat(hb)
        return HeartbeatReply(latest_version=coord.latest_policy().version, finished=coord.finished)

    @app.post(f"{API}/leave")
    def leave(req: LeaveRequest, authorization: str | None = Header(default=None)) -> dict:
        worker_auth(req.worker_id, authorization)
        return {"returned_prompts": coord.leave(req.worker_id)}

    @app.get(f"{API}/policy", dependencies=[Depends(reader_auth)])
    def policy(worker_id: str | None = None) -> PolicyInfo:
        return coord.latest_policy(worker_id)

    @app.get(f"{API}/status", dependencies=[Depends(reader_auth)])
    def status() -> Status:
        return Status(
            run_id=run_id,
            step=coord.version,
            target_steps=target_steps,
            version=coord.latest_policy().version,
            finished=coord.finished,
            workers=coord.worker_views(),
            last_metrics=status_extra(),
        )

    @app.get("/announce/{key}")
    def announce(key: str, request: Request) -> Response:
        """The tracker serves only the learner's node and joined workers, each announcing with its key."""
        if not coord.tracker_key_ok(key):
            return Response(
                bencode({"failure reason": "not a joined peer: join the learner first"}), media_type="text/plain"
            )
        query = parse_announce(request.scope.get("query_string", b""))
        remote = request.client.host if request.client else "127.0.0.1"
        with tracker_lock:
            body = tracker.announce(query, remote)
        return Response(body, media_type="text/plain")

    return app
