"""The pair's other broker (`--peer`): the one address a passive replicates from and the
one name each end's certificate must carry (issue 16, hardened mode).

Without `--peer` a broker replicates from whatever `--replicate-from` / `POST /role`
names, and over mutual TLS accepts any certificate of the CA that names the broker the
handshake claims: whoever holds the admin token can point a passive at a broker of their
own. With it:

- a `replicate_from` is accepted only if its host is the peer's host, or an IP address
  the peer's host resolves to now (the operator dials pod IPs, the peer is the pod's
  stable DNS name), and its port the peer's port when `--peer` names one;
- over mutual TLS each end also requires the other's certificate to name the peer:
  `--replication-tls-server-name` when given (the operator's: the other pod's name), else
  the peer's host. The passive checks it as the TLS host name (`check_hostname`, what it
  did for the server name already); the active checks its client's certificate here
  (`certificate_refusal`: a DNS name, an IP address or the common name). A certificate
  of the same CA for some other broker is refused, whatever name its handshake claims.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

from cryptography import x509

RESOLVE_TIMEOUT = 2.0
"""Seconds the peer's host has to resolve before an IP address is refused."""


def split_address(address: str) -> tuple[str, int | None]:
    """`HOST[:PORT]` as (host, port); the replication link's own form (`rpartition`)."""
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit():
        return address, None
    return host, int(port)


def _same_host(a: str, b: str) -> bool:
    """DNS names compare without case and without a final dot."""
    return a.rstrip(".").lower() == b.rstrip(".").lower()


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


async def _addresses(host: str) -> set[IPAddress]:
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(RESOLVE_TIMEOUT):
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}


class PeerUnresolved(Exception):
    """The peer's DNS name does not resolve now (a pod that is being made again has no
    record yet): the address cannot be checked, which is no refusal; ask again later."""


@dataclass(frozen=True)
class Peer:
    """The configured peer: a host (DNS name or IP address) and, if given, the port of its
    replication listener."""

    host: str
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> Peer:
        """`--peer HOST[:PORT]`."""
        host, port = split_address(text.strip())
        if not host:
            raise ValueError(f"--peer {text!r} names no host")
        return cls(host, port)

    def __str__(self) -> str:
        return self.host if self.port is None else f"{self.host}:{self.port}"

    async def address_refusal(self, address: str) -> str | None:
        """Why a passive may not replicate from `address` (None: it is this peer). Raises
        PeerUnresolved when the peer's name does not resolve, so the address cannot be
        judged either way."""
        host, port = split_address(address)
        if self.port is not None and port != self.port:
            return f"{address} is not the peer {self}: port {port}, not {self.port}"
        if _same_host(host, self.host):
            return None
        try:
            wanted = ipaddress.ip_address(host)
        except ValueError:
            return f"{address} is not the peer {self}"
        try:
            known = await _addresses(self.host)
        except (OSError, TimeoutError) as exc:
            raise PeerUnresolved(
                f"{address}: the peer {self.host} does not resolve ({exc or 'timed out'})"
            ) from exc
        if wanted not in known:
            found = ", ".join(sorted(str(a) for a in known))
            return f"{address} is not the peer {self}, which resolves to {found}"
        return None


def certificate_hosts(writer: asyncio.StreamWriter) -> set[str] | None:
    """The DNS names, IP addresses and common name of a TLS peer's verified certificate
    (None without TLS, empty without a certificate)."""
    ssl_object: Any = writer.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return set()
    cert = x509.load_der_x509_certificate(der)
    names: set[str] = {
        a.value for a in cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        if isinstance(a.value, str)
    }  # fmt: skip
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return names
    names.update(san.get_values_for_type(x509.DNSName))
    names.update(str(ip) for ip in san.get_values_for_type(x509.IPAddress))
    return names


def certificate_refusal(writer: asyncio.StreamWriter, name: str | None) -> str | None:
    """Why the other end of a mutual-TLS link is not the peer (its certificate does not
    name `name`: `BrokerSettings.replication_peer_name`), or None (it does, no peer is
    configured, or the link is plaintext)."""
    if name is None:
        return None
    hosts = certificate_hosts(writer)
    if hosts is None:
        return None
    try:
        wanted = str(ipaddress.ip_address(name))
    except ValueError:
        wanted = name.rstrip(".").lower()
    if any(h.rstrip(".").lower() == wanted for h in hosts):
        return None
    return f"its certificate names {sorted(hosts)}, not the peer {name!r}"
