"""What wraps every request before a route sees it: the Host it names, the body's cap, the body read as JSON
whatever its type, the request's id, HEAD, and CORS.

ASGI middleware rather than FastAPI dependencies, because each must act on answers no route makes: a 421
before anything is read, a 413 before the body is read, the id on a 401, HEAD on a path that declares only
GET, a browser's preflight.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exod.api.errors import Answered, ApiError
from exod.config import is_address

REQUEST_ID = b"x-request-id"
_CLIENTS_ID = re.compile(rb"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe to echo in a header


def host_name(host: bytes) -> str:
    """The name a ``Host`` header gives (``name``, ``name:port``, ``[v6]:port``), without its port, lowercased,
    without a trailing dot: the port is not checked, since a daemon's port can be forwarded or mapped."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):  # an IPv6 literal
        return text[1 : text.find("]")] if "]" in text else text
    if text.count(":") == 1:
        text = text.split(":")[0]
    return text.rstrip(".")


class HostAllowList:
    """Answers only requests whose ``Host`` names this daemon: an IP address written out, or one of ``names``
    (``localhost``, its bind and advertise names, ``[api] allowed_hosts``); any other, 421 before any route.

    Why: DNS rebinding. A page of ``attacker.example`` that rebinds its name to 127.0.0.1 is, for the browser,
    of the same origin as its own API calls, so CORS lets it read every answer; but the browser still sends
    ``Host: attacker.example``, which no name of this daemon matches. A request without a Host (HTTP/1.0) is
    no browser's, and is answered."""

    def __init__(self, app: ASGIApp, names: Iterable[str]) -> None:
        self.app, self.names = app, frozenset(n.lower().strip("[]").rstrip(".") for n in names)

    def allows(self, name: str) -> bool:
        """An address written out is the machine the client chose, which no DNS answer (rebound or not) decides."""
        return not name or name in self.names or "*" in self.names or is_address(name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = [value for key, value in scope.get("headers") or [] if key == b"host"]
        refused = next((host for host in hosts if not self.allows(host_name(host))), None)
        if refused is None:
            await self.app(scope, receive, send)
            return
        name = host_name(refused)
        message = (
            f"this daemon does not answer to the name {name!r} (Host: {refused.decode('latin-1')!r}): only to its "
            "addresses, localhost and the names it is configured with, so that a web page whose name is made to "
            "point at this machine (DNS rebinding) cannot drive it. To allow the name, add it to "
            f'[api] allowed_hosts in the configuration (allowed_hosts = ["{name}"], exod serve --config FILE)'
        )
        # its body unread, the connection cannot serve another request: HTTP/1.1's client is told (HTTP/2 has
        # no such header, and goes on with its other streams)
        closing = {} if scope.get("http_version") == "2" else {"connection": "close"}
        error = ApiError(421, message, code="misdirected_request", headers=closing)
        await error.response(scope["path"])(scope, receive, send)


class BodyCap:
    """A cap on request bodies, declared or chunked, before any route reads one."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self.app, self.max_body = app, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no websocket routes: nothing else gets through unchecked
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            await self._too_big(scope["path"])(scope, receive, send)
            return
        body, more = b"", True
        while more:  # read it all (bounded) so a chunked body cannot slip past the cap
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await self._too_big(scope["path"])(scope, receive, send)
                return
        await self.app(scope, replaying(body, receive), send)

    def _too_big(self, path: str) -> ASGIApp:
        return ApiError(413, f"request body over {self.max_body} bytes").response(path)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body already read, whole, then what the connection says next (a disconnect)."""
    replayed = False

    async def replay() -> dict[str, Any]:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def is_json_type(content_type: bytes) -> bool:
    """``application/json`` or ``application/…+json``, with any parameters: the types FastAPI itself reads as JSON."""
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class JsonBodies:
    """Every request body is read as JSON, whatever its ``Content-Type`` says, as Ollama and mlx_lm.server read
    theirs: ``curl URL -d '{…}'`` (sent as a form) is Ollama's own documented example. A body that is not JSON
    is a 400 in the path's dialect that says so, and how it came. Inside `BodyCap`, so the body is bounded.

    Not from a web page of another site, though: a browser sends a form or ``text/plain`` body to any address
    without asking first (no CORS preflight), so a page a user visits could otherwise drive this daemon (place
    models, run generations: cross-site request forgery). Such a request (an ``Origin`` the ``[api]
    cors_origins`` do not list) is refused 403 unless it says ``Content-Type: application/json``, which a
    browser lets a page send only once this daemon allowed it (the preflight `cors` answers)."""

    def __init__(self, app: ASGIApp, cors_origins: Sequence[str] = ()) -> None:
        self.app, self.origins = app, frozenset(o.encode() for o in cors_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):  # none of those reads a body
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        declared = next((value for key, value in headers if key == b"content-type"), None)
        if declared is not None and is_json_type(declared):
            await self.app(scope, receive, send)  # FastAPI reads it, and says where it is not JSON (`errors`)
            return
        sent = "no Content-Type" if declared is None else f"Content-Type: {declared.decode('latin-1')}"
        if (origin := self._foreign(headers)) is not None:
            refusal = (
                f"a web page's request (Origin: {origin.decode('latin-1')}) must say Content-Type: application/json "
                f"(this one: {sent}), since a page of any site can send other types here unasked. To let a page "
                "call this daemon, list its origin in [api] cors_origins"
            )
            await ApiError(403, refusal, code="forbidden").response(scope["path"])(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if body:
            if (why := _not_json(body)) is not None:
                error = f"the request body must be JSON (read as JSON whatever its type; this one has {sent}): {why}"
                await ApiError(400, error).response(scope["path"])(scope, receive, send)
                return
            others = [(key, value) for key, value in headers if key != b"content-type"]
            scope = {**scope, "headers": [*others, (b"content-type", b"application/json")]}
        await self.app(scope, replaying(body, receive), send)

    def _foreign(self, headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
        """The ``Origin`` of a page of another site, not listed in ``cors_origins``; None for any other request
        (no browser's: no Origin; this daemon's own pages: their origin is the Host they call, which
        `HostAllowList` already checked)."""
        named = dict(headers)
        origin, host = named.get(b"origin"), named.get(b"host", b"")
        if origin is None or origin in self.origins or b"*" in self.origins:
            return None
        return None if host and origin.partition(b"://")[2].lower() == host.lower() else origin


def _not_json(body: bytes) -> str | None:
    """Why ``body`` is not JSON, where, as an editor says it; None if it is."""
    try:
        json.loads(body)
    except json.JSONDecodeError as exc:
        return f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
    except UnicodeDecodeError as exc:
        return f"it is not UTF-8 text ({exc.reason} at byte {exc.start})"
    except (ValueError, RecursionError) as exc:  # nested past Python's limit, say
        return f"it cannot be read ({type(exc).__name__})"
    return None


class RequestId:
    """Every answer carries ``x-request-id``: the client's own if it sent a usable one (so that its logs and
    the answer name the same request), else a fresh one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(REQUEST_ID, b"")
        request_id = given if _CLIENTS_ID.fullmatch(given) else f"req_{secrets.token_hex(12)}".encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID]
                message = {**message, "headers": [*headers, (REQUEST_ID, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class HeadAsGet:
    """HEAD answered wherever GET is, as HTTP says: the GET's status and headers, no body. (FastAPI routes
    declared with GET take no HEAD, and hypercorn leaves a HEAD's body to the application.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.start":
                await send(message)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                raise Answered  # what the GET would go on to write (an endless stream too) is not wanted

        try:
            await self.app({**scope, "method": "GET"}, receive, headers_only)
        except* Answered:
            pass


def cors(app: ASGIApp, origins: Sequence[str]) -> ASGIApp:
    """Let pages of ``origins`` (``*``: any) call the API from a browser, preflight answered; nothing when
    empty, the default: a page of any site a user visits could otherwise drive a daemon on their machine.

    Never with credentials: a browser sends no cookie and no stored authorisation, so a page must hold the
    API key itself to use one, and the key is never reflected in an answer."""
    if not origins:
        return app
    return CORSMiddleware(
        app,
        allow_origins=list(origins),
        allow_methods=["GET", "POST", "DELETE", "OPTIONS", "HEAD"],
        allow_headers=["*"],
        allow_credentials=False,
        expose_headers=["x-request-id", "retry-after"],
        max_age=600,
    )
