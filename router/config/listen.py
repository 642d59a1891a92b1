"""Listen addresses, as llama-server takes them, bound before anything starts.

``--host`` is a comma-separated list (llama-server's ``--host`` since it took several): IPv4
and IPv6 literals (``::1``, also written ``[::1]``), ``0.0.0.0``, ``::`` and host names
(``localhost``: every address it resolves to). Each is bound on ``--port``; with port 0 the
first gets a free port and the others the same one.

* One socket in all: an IPv6 wildcard (``::``) also takes IPv4 (dual stack, as llama-server).
  Several: each IPv6 socket is IPv6 only (llama-server's rule), so ``0.0.0.0,::`` works.
* Every socket is bound and listening before the router starts a child or loads a model;
  one that cannot be is a ``ListenError`` naming the address and the system's reason, and
  closes those already bound. (Clients that connect before the app is up wait in the
  backlog instead of being refused.)
* UNIX socket paths (llama-server's ``*.sock`` hosts) are refused: the router serves TCP.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from ..errors import ConfigurationError

BACKLOG = 2048  # uvicorn's default


class ListenError(ConfigurationError):
    """An address that cannot be listened on (taken, not on this machine, unresolvable)."""


def parse_hosts(value: str) -> list[str]:
    """The addresses of a ``--host`` value: comma separated, blanks dropped, ``[v6]`` brackets
    removed; ValueError for none, a UNIX socket path or an unbalanced bracket."""
    hosts: list[str] = []
    for part in value.split(","):
        host = part.strip()
        if not host:
            continue
        if host.endswith(".sock"):
            raise ValueError(f"{host!r}: UNIX sockets are not supported; give IP addresses "
                             "or host names")
        if host.startswith("[") or host.endswith("]"):
            if not (host.startswith("[") and host.endswith("]") and len(host) > 2):
                raise ValueError(f"{host!r}: unbalanced brackets")
            host = host[1:-1]
        if host not in hosts:
            hosts.append(host)
    if not hosts:
        raise ValueError("--host needs at least one address")
    return hosts


def url_host(host: str) -> str:
    """``host`` as in a URL: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host else host


@dataclass
class Listeners:
    """The bound, listening sockets and the URLs they serve."""

    sockets: list[socket.socket]
    urls: list[str]

    @property
    def port(self) -> int:
        port: int = self.sockets[0].getsockname()[1]
        return port

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def _resolve(host: str, port: int) -> list[tuple[int, str, tuple[int, ...]]]:
    """``(family, ip, rest)`` of each address ``host`` means (rest: an IPv6 address's flow
    info and scope, as ``fe80::1%eth0`` needs)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {url_host(host)}:{port}: {exc.strerror}") from None
    addresses: list[tuple[int, str, tuple[int, ...]]] = []
    for family, _, _, _, sockaddr in found:
        if family in (socket.AF_INET, socket.AF_INET6):
            address = (int(family), str(sockaddr[0]), tuple(int(x) for x in sockaddr[2:]))
            if address not in addresses:
                addresses.append(address)
    return addresses


def bind(hosts: list[str], port: int) -> Listeners:
    """Bind and listen on every address of ``hosts`` on ``port`` (see the module docstring)."""
    listeners = Listeners([], [])
    try:
        planned = [(host, address) for host in hosts for address in _resolve(host, port)]
        for host, (family, ip, rest) in planned:
            if listeners.sockets and port == 0:
                port = listeners.port  # the port the first address got
            sock = socket.socket(family, socket.SOCK_STREAM)
            listeners.sockets.append(sock)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, len(planned) > 1)
                sock.bind((ip, port, *rest))
                sock.listen(BACKLOG)
            except OSError as exc:
                shown = url_host(host) if host == ip else f"{url_host(host)} ({ip})"
                raise ListenError(f"cannot listen on {shown}:{port}: "
                                  f"{exc.strerror or exc}") from None
            listeners.urls.append(f"http://{url_host(ip)}:{listeners.sockets[-1].getsockname()[1]}")
    except BaseException:
        listeners.close()
        raise
    return listeners
