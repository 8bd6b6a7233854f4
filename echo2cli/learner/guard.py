"""The learner's front door: credentials and body size are checked before a request body is read.

FastAPI reads and parses a whole JSON body before any dependency or handler runs, so authentication there
comes too late: a 118 MB body without a token cost the learner 10.7 s of CPU and 1.1 GB of memory before
its 403. This ASGI middleware runs first. It answers from the request line and headers alone:

    401  no valid credentials for this path (`authorize(path, token)` says which and why)
    413  Content-Length above the path's limit, or a streamed (chunked) body that grows past it

and only then lets the request through, counting the body's bytes as the app reads them. The limits
come from the run (`body_limits`): a rollout batch holds at most B prompts x G samples of at most
max_new_tokens tokens, each token id and log-prob a few dozen bytes of JSON.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SMALL_BODY = 16 << 10  # join, lease, heartbeat, leave: a few hundred bytes of JSON
JSON_BYTES_PER_TOKEN = 48  # a token id ("151935,") and its log-prob ("-12.345678901234567,") with room to spare
JSON_BYTES_PER_SAMPLE = 512  # ids, keys and punctuation around each sample


def rollout_body_limit(prompts_per_step: int, group_size: int, max_new_tokens: int) -> int:
    """Bytes of the largest honest `/v1/rollouts` body, doubled for margin (B x G samples, T tokens each)."""
    samples = prompts_per_step * group_size
    return 2 * (samples * (max_new_tokens * JSON_BYTES_PER_TOKEN + JSON_BYTES_PER_SAMPLE) + 4096)


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        authorize: Callable[[str, str], tuple[int, str] | None],
        limit: Callable[[str], int],
    ) -> None:
        """`authorize(path, bearer_token)` → None to let it in, else (status, detail); `limit(path)` → bytes."""
        self.app, self.authorize, self.limit = app, authorize, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        auth = headers.get(b"authorization", b"").decode("latin-1")
        refused = self.authorize(path, auth[7:] if auth.startswith("Bearer ") else "")
        if refused is not None:
            await _answer(send, *refused)
            return
        limit = self.limit(path)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _answer(send, 413, f"request body over {limit} bytes, the most {path} takes in this run")
            return
        received = 0
        answered = False

        async def counted_receive() -> Message:
            nonlocal received, answered
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit and not answered:
                    # Answer now and tell the app the client left: whatever it makes of that (FastAPI turns
                    # any error while reading into a 400) is dropped by `guarded_send`.
                    answered = True
                    await _answer(send, 413, f"request body over {limit} bytes, the most {path} takes in this run")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not answered:
                await send(message)

        await self.app(scope, counted_receive, guarded_send)


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
