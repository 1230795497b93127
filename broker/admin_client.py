"""The one client of a broker's admin API, for the operator, demos, benchmarks and tests.

`broker/admin.py` serves the API and `broker/api.py` shapes it; this module is the
only code that calls it. Every call is defined once (`Call`: method, path, body,
how to read the answer) and sent by either client: `AdminClient` (asyncio) or
`SyncAdminClient` (threads and scripts), both on a pooled httpx client with a
timeout on every request. Failures come out as the exceptions below, never as
httpx's or pydantic's, so a caller can tell a stale epoch from a broker that is gone.

A client may share one httpx pool with others (`http=`): the operator talks to
many brokers through one pool, each client naming its broker's URL and token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from twinmq.broker.api import (
    BROKER_DAMAGED,
    MIRROR_NOT_DRAINED,
    MIRROR_REFUSED,
    STALE_EPOCH,
    BrokerStatus,
    ErrorBody,
    MirrorDemoteRequest,
    MirrorPromoteRequest,
    MirrorReseed,
    MirrorSwitch,
    Readiness,
    Role,
    RoleRequest,
    VhostDeleted,
)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
DEFAULT_TIMEOUT = 5.0


class AdminError(Exception):
    """The admin API refused a call, answered nonsense, or did not answer."""

    def __init__(self, message: str, status: int | None = None, body: ErrorBody | None = None):
        super().__init__(message)
        self.status = status
        self.body = body


class AdminUnreachable(AdminError):
    """No answer: connection refused or reset, no route, or the broker closed the socket."""


class AdminTimeout(AdminUnreachable):
    """No answer within the request's timeout (a paused or cut-off broker)."""


class Unauthorized(AdminError):
    """HTTP 401: a missing or wrong token (or no token configured and not on loopback)."""


class Forbidden(AdminError):
    """HTTP 403: the read-only token asked to change something."""


class StaleEpoch(AdminError):
    """HTTP 409: the role change carried an epoch older than the broker's."""


class BrokerDamaged(AdminError):
    """HTTP 409: the broker's journal is damaged; activating it needs `force`."""


class MirrorRefused(AdminError):
    """HTTP 409: a DR switch that cannot happen (role, stale or unmet token)."""


class MirrorNotDrained(AdminError):
    """HTTP 503: the demotion's queue did not drain in time; the site stays fenced, call
    again."""


@dataclass(frozen=True)
class Call(Generic[T]):
    """One admin API call: what to send and how to read a successful answer."""

    method: str
    path: str
    read: Callable[[httpx.Response], T]
    body: BaseModel | None = None
    accept: frozenset[int] = frozenset({200})  # statuses whose body `read` understands


def _model(model: type[M]) -> Callable[[httpx.Response], M]:
    return lambda response: model.model_validate_json(response.content)


def status_call() -> Call[BrokerStatus]:
    """`GET /status`."""
    return Call("GET", "/status", _model(BrokerStatus))


def role_call(request: RoleRequest) -> Call[BrokerStatus]:
    """`POST /role`: the broker's status once the change is made."""
    return Call("POST", "/role", _model(BrokerStatus), body=request)


def readiness_call() -> Call[Readiness]:
    """`GET /readyz` (open: no token needed); 503 is an answer too (not ready)."""
    return Call("GET", "/readyz", _model(Readiness), accept=frozenset({200, 503}))


def metrics_call() -> Call[str]:
    """`GET /metrics`: Prometheus text."""
    return Call("GET", "/metrics", lambda response: response.text)


def mirror_demote_call(request: MirrorDemoteRequest) -> Call[MirrorSwitch]:
    """`POST /mirror/demote` on the DR source: its demotion token once drained."""
    return Call("POST", "/mirror/demote", _model(MirrorSwitch), body=request)


def mirror_promote_call(request: MirrorPromoteRequest) -> Call[MirrorSwitch]:
    """`POST /mirror/promote` on a DR replica (with a token, or `force`)."""
    return Call("POST", "/mirror/promote", _model(MirrorSwitch), body=request)


def mirror_reseed_call() -> Call[MirrorReseed]:
    """`POST /mirror/reseed` on the DR source's active broker: rebuild the mirror."""
    return Call("POST", "/mirror/reseed", _model(MirrorReseed))


def vhost_delete_call(name: str) -> Call[VhostDeleted]:
    """`DELETE /vhosts/{name}` on the active broker: a retired vhost's content, deleted."""
    return Call("DELETE", f"/vhosts/{quote(name, safe='')}", _model(VhostDeleted))


def refusal(response: httpx.Response) -> AdminError:
    """The exception for an HTTP error answer (the body is an ErrorBody when the broker sent
    it; a proxy's or an older broker's page is kept as the detail)."""
    try:
        body = ErrorBody.model_validate_json(response.content)
    except ValidationError:
        body = ErrorBody(error=response.reason_phrase or "error", detail=response.text[:200])
    message = f"{response.request.method} {response.request.url.path}: HTTP " + (
        f"{response.status_code} {body.error}" + (f": {body.detail}" if body.detail else "")
    )
    kind: type[AdminError] = AdminError
    if response.status_code == 401:
        kind = Unauthorized
    elif response.status_code == 403:
        kind = Forbidden
    elif response.status_code == 409 and body.error == STALE_EPOCH:
        kind = StaleEpoch
    elif response.status_code == 409 and body.error == BROKER_DAMAGED:
        kind = BrokerDamaged
    elif response.status_code == 409 and body.error == MIRROR_REFUSED:
        kind = MirrorRefused
    elif response.status_code == 503 and body.error == MIRROR_NOT_DRAINED:
        kind = MirrorNotDrained
    return kind(message, response.status_code, body)


def transport_failure(call: Call[T], url: str, exc: httpx.RequestError) -> AdminError:
    """The exception for a request that got no HTTP answer."""
    what = f"{call.method} {url}{call.path}"
    if isinstance(exc, httpx.TimeoutException):
        return AdminTimeout(f"{what}: no answer in time ({type(exc).__name__})")
    return AdminUnreachable(f"{what}: {type(exc).__name__}: {exc}")


def answer(call: Call[T], response: httpx.Response) -> T:
    """Read a response, or raise what it means."""
    if response.status_code not in call.accept:
        raise refusal(response)
    try:
        return call.read(response)
    except ValidationError as exc:
        raise AdminError(
            f"{call.method} {call.path}: the answer is not the admin API's shape: {exc}",
            response.status_code,
        ) from exc


def metric_samples(text: str) -> dict[str, float]:
    """The samples of a `GET /metrics` answer by name with labels as written
    (`twinmq_epoch 3`, `twinmq_replication_refused_total{reason="over-cap"}`)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class _Client:
    """What both clients share: the broker's URL, the token, building requests."""

    def __init__(
        self, url: str, token: str | None, timeout: float, server_name: str | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        # HTTPS to an address (a pod IP) whose certificate names the broker instead: the
        # name the server is verified by (and sent as SNI).
        self._extensions = {"sni_hostname": server_name} if server_name else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._json_headers = {**self._headers, "Content-Type": "application/json"}

    def _request(
        self, http: httpx.Client | httpx.AsyncClient, call: Call[T], timeout: float | None
    ) -> httpx.Request:
        return http.build_request(
            call.method,
            self.url + call.path,
            headers=self._headers if call.body is None else self._json_headers,
            content=None if call.body is None else call.body.model_dump_json(),
            timeout=self.timeout if timeout is None else timeout,
            extensions=self._extensions,
        )

    @staticmethod
    def _role(
        role: Role, epoch: int, replicate_from: str | None, force: bool
    ) -> Call[BrokerStatus]:
        request = RoleRequest(role=role, epoch=epoch, replicate_from=replicate_from, force=force)
        return role_call(request)


class AdminClient(_Client):
    """The admin API of one broker, for asyncio code.

    `AdminClient("http://10.0.0.7:15672", token)`; `async with` closes the pool it made
    (a pool passed in as `http` belongs to the caller). Every call has the client's
    `timeout` (asyncio code that wants less wraps the call in `asyncio.timeout`)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(url, token, timeout)
        self._owned = http is None
        self.http = http if http is not None else httpx.AsyncClient()

    async def send(self, call: Call[T]) -> T:
        """Make one call (within the client's timeout)."""
        try:
            response = await self.http.send(self._request(self.http, call, None))
        except httpx.RequestError as exc:
            raise transport_failure(call, self.url, exc) from exc
        return answer(call, response)

    async def status(self) -> BrokerStatus:
        """`GET /status`."""
        return await self.send(status_call())

    async def set_role(
        self,
        role: Role,
        epoch: int,
        replicate_from: str | None = None,
        *,
        force: bool = False,
    ) -> BrokerStatus:
        """`POST /role`; raises StaleEpoch or BrokerDamaged when the broker refuses."""
        return await self.send(self._role(role, epoch, replicate_from, force))

    async def readiness(self) -> Readiness:
        """`GET /readyz`."""
        return await self.send(readiness_call())

    async def metrics(self) -> str:
        """`GET /metrics`."""
        return await self.send(metrics_call())

    async def aclose(self) -> None:
        """Close the pool, if this client made it."""
        if self._owned:
            await self.http.aclose()

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class SyncAdminClient(_Client):
    """The admin API of one broker, for threads and scripts (the same calls, blocking)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        http: httpx.Client | None = None,
        server_name: str | None = None,
    ) -> None:
        super().__init__(url, token, timeout, server_name)
        self._owned = http is None
        self.http = http if http is not None else httpx.Client()

    def send(self, call: Call[T], timeout: float | None = None) -> T:
        """Make one call."""
        try:
            response = self.http.send(self._request(self.http, call, timeout))
        except httpx.RequestError as exc:
            raise transport_failure(call, self.url, exc) from exc
        return answer(call, response)

    def status(self, *, timeout: float | None = None) -> BrokerStatus:
        """`GET /status`."""
        return self.send(status_call(), timeout)

    def set_role(
        self,
        role: Role,
        epoch: int,
        replicate_from: str | None = None,
        *,
        force: bool = False,
        timeout: float | None = None,
    ) -> BrokerStatus:
        """`POST /role`; raises StaleEpoch or BrokerDamaged when the broker refuses."""
        return self.send(self._role(role, epoch, replicate_from, force), timeout)

    def readiness(self, *, timeout: float | None = None) -> Readiness:
        """`GET /readyz`."""
        return self.send(readiness_call(), timeout)

    def metrics(self, *, timeout: float | None = None) -> str:
        """`GET /metrics`."""
        return self.send(metrics_call(), timeout)

    def delete_vhost(self, name: str, *, timeout: float | None = None) -> VhostDeleted:
        """`DELETE /vhosts/{name}`; AdminError (409, 404) when the broker refuses."""
        return self.send(vhost_delete_call(name), timeout)

    def close(self) -> None:
        """Close the pool, if this client made it."""
        if self._owned:
            self.http.close()

    def __enter__(self) -> SyncAdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
