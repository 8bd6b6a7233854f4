"""The learner's HTTP API (`/v1/...`) and BitTorrent tracker (`/announce`), as one FastAPI app.

Handlers are thin: they check the token, validate the body with the shared `protocol` models and call
the `Coordinator`. 401 = wrong or missing token; 404 = unknown worker (join again); 422 = malformed body.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse

from echo2cli.broadcast.tracker import Tracker, parse_announce
from echo2cli.learner.coordinator import Coordinator
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
)


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

    @app.exception_handler(RequestValidationError)
    def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes the offending input back, and an input such as 1e400 (inf) cannot be
        # written as JSON: that turned a client's bad body into a 500. Send location and message only.
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)
    tracker = Tracker()
    tracker_lock = threading.Lock()

    def auth(authorization: str | None = Header(default=None)) -> None:
        if token is not None and authorization != f"Bearer {token}":
            raise HTTPException(401, "wrong or missing token: pass --token with the learner's secret")

    def known(worker_id: str) -> None:
        if coord.cut_off(worker_id):
            raise HTTPException(403, f"worker {worker_id} was cut off after {coord.max_bad_batches} batches of "
                                "invalid rollouts in a row")
        if not coord.known(worker_id):
            raise HTTPException(404, f"unknown worker {worker_id}: join again")

    guarded = [Depends(auth)]

    @app.post(f"{API}/join", dependencies=guarded)
    def join(req: JoinRequest) -> JoinResponse:
        worker_id = coord.join(req.name, req.usd_per_hour)
        return JoinResponse(worker_id=worker_id, run_id=run_id, policy=coord.latest_policy(worker_id), **join_info)

    @app.get(f"{API}/model/files/{{name}}", dependencies=guarded)
    def model_file(name: str) -> FileResponse:
        if name not in model_files:
            raise HTTPException(404, f"no model file {name!r}")
        return FileResponse(model_dir / name)

    @app.post(f"{API}/lease", dependencies=guarded)
    def lease(req: LeaseRequest) -> LeaseResponse:
        known(req.worker_id)
        return coord.lease(req.worker_id, req.version, req.max_prompts)

    @app.post(f"{API}/rollouts", dependencies=guarded)
    def rollouts(batch: RolloutBatch) -> SubmitResult:
        known(batch.worker_id)
        return coord.submit(batch)

    @app.post(f"{API}/heartbeat", dependencies=guarded)
    def heartbeat(hb: Heartbeat) -> HeartbeatReply:
        known(hb.worker_id)
        coord.heartbeat(hb)
        return HeartbeatReply(latest_version=coord.latest_policy().version, finished=coord.finished)

    @app.post(f"{API}/leave", dependencies=guarded)
    def leave(req: LeaveRequest) -> dict:
        known(req.worker_id)
        return {"returned_prompts": coord.leave(req.worker_id)}

    @app.get(f"{API}/policy", dependencies=guarded)
    def policy(worker_id: str | None = None) -> PolicyInfo:
        return coord.latest_policy(worker_id)

    @app.get(f"{API}/status", dependencies=guarded)
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

    @app.get("/announce")
    def announce(request: Request) -> Response:
        query = parse_announce(request.scope.get("query_string", b""))
        remote = request.client.host if request.client else "127.0.0.1"
        with tracker_lock:
            body = tracker.announce(query, remote)
        return Response(body, media_type="text/plain")

    return app
