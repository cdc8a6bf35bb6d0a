"""A small etcd v3 client over etcd's JSON gateway, on httpx, for trio.

Why our own: ``etcd3`` breaks on protobuf >= 4 and ``aetcd`` is asyncio-only; etcd documents its v3 JSON
gateway (``POST /v3/kv/range`` …, keys and values base64, 64-bit numbers as strings, zero values left
out), and httpx speaks it under trio, streaming included. So this module is the gateway's operations and
nothing else: it decides nothing about exod's keys (that is the cluster store's business).

Errors: `EtcdUnavailable` when etcd cannot be reached or answers 5xx (the caller degrades and retries);
`EtcdError` when etcd refused the request (a bug of ours, or an expired lease: `LeaseExpired`).

Secured as its operator secures it (`EtcdSecurity`): TLS with the cluster's CA and this node's client
certificate, and etcd's own authentication (a user and password for a token, which is asked for again
when etcd says it is no longer valid). Who can write to etcd owns the cluster, as in Kubernetes.
"""

from __future__ import annotations

import base64
import json
import math
import ssl
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio


class EtcdError(Exception):
    """etcd refused the request; the message is etcd's."""


class EtcdUnavailable(EtcdError):
    """etcd cannot be reached, or failed to answer (5xx, a timeout): try again later."""


class LeaseExpired(EtcdError):
    """The lease is gone (expired, or revoked): whatever was attached to it is gone too."""


@attrs.frozen
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


@attrs.frozen
class Event:
    """One change seen by a watch: a put (``kv`` is the new value) or a delete (``kv.value`` is empty)."""

    deleted: bool
    kv: KeyValue


# -- transactions ----------------------------------------------------------------------------------------


@attrs.frozen
class Compare:
    """``key``'s ``target`` (value, version, create or mod revision, lease) compared with ``value``; with
    ``range_end``, that of every key in [``key``, ``range_end``) (true of an empty range unless it compares a
    value: etcd compares an absent key's numbers as 0)."""

    key: bytes
    target: str  # "VALUE" | "VERSION" | "CREATE" | "MOD" | "LEASE"
    result: str  # "EQUAL" | "NOT_EQUAL" | "GREATER" | "LESS"
    value: bytes | int
    range_end: bytes | None = None

    def body(self) -> dict[str, Any]:
        field = {"VALUE": "value", "VERSION": "version", "CREATE": "create_revision", "MOD": "mod_revision"}
        field |= {"LEASE": "lease"}
        value = _b64(self.value) if self.target == "VALUE" else str(self.value)
        body = {"key": _b64(self.key), "target": self.target, "result": self.result, field[self.target]: value}
        return body | ({} if self.range_end is None else {"range_end": _b64(self.range_end)})


@attrs.frozen
class Put:
    key: bytes
    value: bytes
    lease: int = 0

    def body(self) -> dict[str, Any]:
        request = {"key": _b64(self.key), "value": _b64(self.value)}
        return {"request_put": request | ({"lease": str(self.lease)} if self.lease else {})}


@attrs.frozen
class Delete:
    """``key``; every key under it (``prefix``); or every key in [``key``, ``range_end``)."""

    key: bytes
    prefix: bool = False
    range_end: bytes | None = None

    def body(self) -> dict[str, Any]:
        end = _prefix_end(self.key) if self.prefix else self.range_end
        request = {"key": _b64(self.key)} | ({"range_end": _b64(end)} if end is not None else {})
        return {"request_delete_range": request}


@attrs.frozen
class TxnResult:
    succeeded: bool
    revision: int


def version_is(key: bytes, version: int) -> Compare:
    """The key has been written ``version`` times since it was created (0: it does not exist)."""
    return Compare(key, "VERSION", "EQUAL", version)


def value_is(key: bytes, value: bytes) -> Compare:
    return Compare(key, "VALUE", "EQUAL", value)


def unchanged_since(prefix: bytes, revision: int) -> Compare:
    """No key under ``prefix`` was written after ``revision`` (a key deleted since is not seen: a read at
    ``revision`` and a transaction with this comparison see the same keys, or fewer)."""
    return Compare(prefix, "MOD", "LESS", revision + 1, range_end=_prefix_end(prefix))


# -- the client ----------------------------------------------------------------------------------------


@attrs.frozen
class EtcdSecurity:
    """How this node reaches a secured etcd: the CA its members' certificates are signed by, this node's
    client certificate and key (etcd's ``--client-cert-auth``), and a user of etcd's own authentication."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str = attrs.field(default="", repr=False)

    def __attrs_post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate: give both")
        if self.user is not None and not self.password:
            raise ValueError(f"etcd user {self.user!r} needs a password (a file with it)")

    def ssl_context(self) -> ssl.SSLContext | bool:
        """What httpx verifies the members with: the system's CAs unless a CA is given; the client certificate."""
        if self.ca is None and self.cert is None:
            return True
        context = ssl.create_default_context(cafile=None if self.ca is None else str(self.ca))
        if self.cert is not None and self.key is not None:
            context.load_cert_chain(str(self.cert), str(self.key))
        return context


class Etcd:
    """An etcd cluster through its members' endpoints (``http://A:2379,http://B:2379,…``): every call is one
    HTTP request with a timeout, to the member in use; a member that cannot be connected to is passed over
    for the next one (a request that never left cannot have been applied, so trying it elsewhere is safe),
    and a member that failed after the request left is left for the next call (which may not be repeated)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        client: httpx.AsyncClient | None = None,
        security: EtcdSecurity | None = None,
    ) -> None:
        self.url = url
        self.endpoints = [endpoint.strip().rstrip("/") for endpoint in url.split(",") if endpoint.strip()]
        if not self.endpoints:
            raise ValueError(f"no etcd endpoint in {url!r}: give http://HOST:2379, or several separated by commas")
        self.timeout = timeout
        self.security = security or EtcdSecurity()
        self._client = client or httpx.AsyncClient(timeout=timeout, verify=self.security.ssl_context())
        self._member = 0  # the endpoint in use
        self._token: str | None = None  # etcd's authentication token, once asked for

    @property
    def _endpoint(self) -> str:
        return self.endpoints[self._member]

    def _next_member(self) -> None:
        self._member = (self._member + 1) % len(self.endpoints)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Write; returns the revision of the write."""
        body = Put(key, value, lease).body()["request_put"]
        return _int(_header(await self._call("/v3/kv/put", body)).get("revision"))

    async def get(self, key: bytes) -> KeyValue | None:
        return (await self.read(key))[0]

    async def read(self, key: bytes) -> tuple[KeyValue | None, int]:
        """The key (None if absent) and the store's revision it was read at: a watch from that revision + 1
        misses nothing, even once the key's own revisions are compacted away."""
        kvs, revision = await self._range({"key": _b64(key)})
        return (kvs[0] if kvs else None), revision

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix``, sorted by key, and the store's revision they were read at."""
        return await self._range({"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})

    async def range(self, start: bytes, end: bytes, *, limit: int = 0, descending: bool = False) -> list[KeyValue]:
        """The keys in [``start``, ``end``) by key (last first if ``descending``), at most ``limit`` (0: all)."""
        body: dict[str, Any] = {"key": _b64(start), "range_end": _b64(end)}
        if limit:
            body["limit"] = str(limit)
        if descending:
            body |= {"sort_order": "DESCEND", "sort_target": "KEY"}
        kvs, _ = await self._range(body)
        return kvs

    async def compact(self, revision: int) -> None:
        """Drop the history older than ``revision`` (etcd keeps every revision of every key until told)."""
        await self._call("/v3/kv/compaction", {"revision": str(revision)})

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it); returns how many keys were deleted."""
        answer = await self._call("/v3/kv/deleterange", Delete(key, prefix).body()["request_delete_range"])
        return _int(answer.get("deleted"))

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Put | Delete], failure: Sequence[Put | Delete] = ()
    ) -> TxnResult:
        """If every comparison holds, ``success`` is applied, else ``failure``: atomically, at one revision."""
        body = {
            "compare": [c.body() for c in compare],
            "success": [op.body() for op in success],
            "failure": [op.body() for op in failure],
        }
        answer = await self._call("/v3/kv/txn", body)
        return TxnResult(bool(answer.get("succeeded", False)), _int(_header(answer).get("revision")))

    async def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""
        answer = await self._call("/v3/lease/grant", {"TTL": str(ttl)})
        return _int(answer["ID"])

    async def keep_alive(self, lease: int, *, timeout: float | None = None) -> int:
        """Renew ``lease``; returns its TTL. `LeaseExpired` if it is gone. ``timeout``: give up sooner than the
        client would (`EtcdUnavailable`), and ask the next member next time: a renewal must fail while the
        lease's slack still lets another member be asked — a member killed in silence, or waiting for a new
        leader, would otherwise hold it past the node's authority."""
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        except trio.TooSlowError:
            self._next_member()  # a renewal may be repeated: the next one goes to the next member at once
            raise EtcdUnavailable(f"etcd at {self.url} did not renew lease {lease:x} within {timeout:.2f} s") from None
        ttl = _int(answer.get("result", {}).get("TTL"))
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease:x} has expired")
        return ttl

    async def time_to_live(self, lease: int) -> tuple[int, int]:
        """(seconds left, TTL granted) of ``lease``; (-1, 0) if it is gone."""
        answer = await self._call("/v3/lease/timetolive", {"ID": str(lease)})
        return (_int(answer.get("TTL")) if "TTL" in answer else -1), _int(answer.get("grantedTTL"))

    async def revoke(self, lease: int) -> None:
        """End ``lease`` now: every key attached to it is deleted."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    async def watch(self, prefix: bytes, *, start_revision: int = 0) -> AsyncIterator[Event]:
        """Every change under ``prefix`` from ``start_revision`` (0: from now), as it happens, in order.

        Runs until cancelled; `EtcdUnavailable` if the stream breaks (resume from the last revision seen + 1).
        """
        create = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}
        if start_revision:
            create["start_revision"] = str(start_revision)
        try:
            timeout = httpx.Timeout(self.timeout, read=None)  # a watch waits as long as nothing changes
            url, headers = f"{self._endpoint}/v3/watch", await self._headers()
            request = {"json": {"create_request": create}, "timeout": timeout, "headers": headers}
            async with self._client.stream("POST", url, **request) as response:
                if response.status_code != 200:
                    raise EtcdUnavailable(f"etcd at {self.url} refused the watch: HTTP {response.status_code}")
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    message = json.loads(line)
                    if "error" in message:
                        raise EtcdUnavailable(f"etcd watch at {self.url} failed: {message['error']}")
                    for raw in message.get("result", {}).get("events", []):
                        yield Event(raw.get("type") == "DELETE", _kv(raw.get("kv", {})))
        except (httpx.HTTPError, trio.BrokenResourceError) as exc:
            self._next_member()  # the watch is made again by its caller: on the next member
            raise EtcdUnavailable(f"etcd watch at {self.url} broke: {type(exc).__name__}: {exc}") from exc

    # -- the gateway ------------------------------------------------------------------------------------

    async def _range(self, body: dict[str, Any]) -> tuple[list[KeyValue], int]:
        answer = await self._call("/v3/kv/range", body)
        return [_kv(raw) for raw in answer.get("kvs", [])], _int(_header(answer).get("revision"))

    async def _headers(self) -> dict[str, str]:
        """etcd's token, asked for with the user's password when there is none yet (etcd's authentication)."""
        if self.security.user is None:
            return {}
        if self._token is None:
            credentials = {"name": self.security.user, "password": self.security.password}
            answer = await self._post("/v3/auth/authenticate", credentials, {})
            self._token = str(answer.get("token", ""))
        return {"Authorization": self._token}

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._post(path, body, await self._headers())
        except EtcdError as exc:
            if self.security.user is None or "auth token" not in str(exc):
                raise
        self._token = None  # expired, or issued by another member (etcd's simple tokens): ask again, once
        return await self._post(path, body, await self._headers())

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        for _ in self.endpoints:
            try:
                response = await self._client.post(f"{self._endpoint}{path}", json=body, headers=headers)
                break
            except httpx.ConnectError as exc:  # never sent: the next member may take it
                self._next_member()
                failure: httpx.HTTPError = exc
            except httpx.HTTPError as exc:  # sent, maybe applied: not repeated; the next call goes elsewhere
                self._next_member()
                raise EtcdUnavailable(f"cannot reach etcd at {self.url}: {_why(exc)}") from exc
        else:
            raise EtcdUnavailable(f"cannot reach etcd at {self.url}: {_why(failure)}") from failure
        if response.status_code >= 500:
            self._next_member()
            raise EtcdUnavailable(f"etcd at {self.url} failed: HTTP {response.status_code}: {response.text[:200]}")
        try:
            answer = response.json()
        except ValueError:  # not the gateway's JSON: say what came
            raise EtcdError(f"etcd refused {path}: HTTP {response.status_code}: {response.text[:200]}") from None
        if response.status_code != 200 or "error" in answer:
            message = answer.get("message") or answer.get("error") or response.text[:200]
            if "lease not found" in str(message):
                raise LeaseExpired(str(message))
            raise EtcdError(f"etcd refused {path}: {message}")
        return answer


def _why(exc: BaseException) -> str:
    """The exception, and what caused it (a TLS handshake's failure says nothing at the top of the chain)."""
    reasons: list[str] = []
    at: BaseException | None = exc
    while at is not None and len(reasons) < 3:
        if str(at) and str(at) not in reasons:
            reasons.append(str(at))
        at = at.__cause__ or at.__context__
    return f"{type(exc).__name__}: {'; '.join(reasons) or 'no reason given'}"


def _b64(data: bytes | int) -> str:
    raw = data if isinstance(data, bytes) else str(data).encode()
    return base64.b64encode(raw).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's range_end for a prefix)."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # every key


def _int(value: Any) -> int:
    return int(value) if value not in (None, "") else 0


def _header(answer: dict[str, Any]) -> dict[str, Any]:
    return answer.get("header", {})


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=base64.b64decode(raw.get("key", "")),
        value=base64.b64decode(raw.get("value", "")),
        create_revision=_int(raw.get("create_revision")),
        mod_revision=_int(raw.get("mod_revision")),
        version=_int(raw.get("version")),
        lease=_int(raw.get("lease")),
    )
