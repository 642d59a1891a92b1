"""Listen addresses (``router.config.listen``): ``--host`` parsed as llama-server takes it, and
every address bound or refused by name. The sockets are real, on loopback; no process starts.
(A router on several addresses with real children: ``test_listen_real.py``.)"""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from router.config.listen import ListenError, bind, parse_hosts, url_host
from router.config.settings import ConfigurationError, Settings


def ipv6_loopback() -> bool:
    """Whether this machine has ``::1`` (containers without IPv6 do not)."""
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1) here")


@pytest.mark.parametrize(("value", "hosts"), [
    ("127.0.0.1", ["127.0.0.1"]),
    ("127.0.0.1,::1", ["127.0.0.1", "::1"]),
    (" 127.0.0.1 , [::1] ,", ["127.0.0.1", "::1"]),
    ("::", ["::"]), ("[::]", ["::"]), ("0.0.0.0,::", ["0.0.0.0", "::"]),
    ("localhost", ["localhost"]), ("::1,[::1],::1", ["::1"]),
])
def test_host_lists_as_llama_server_takes_them(value: str, hosts: list[str]) -> None:
    assert parse_hosts(value) == hosts
    assert Settings(host=value).hosts() == hosts


@pytest.mark.parametrize(("value", "problem"), [
    ("", "at least one address"), (" , ,", "at least one address"),
    ("[::1", "unbalanced brackets"), ("::1]", "unbalanced brackets"), ("[]", "unbalanced"),
    ("/run/llama.sock", "UNIX sockets are not supported"),
])
def test_host_lists_that_hold_no_usable_address_are_refused(value: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_hosts(value)
    if value:
        with pytest.raises(ValidationError, match=problem):
            Settings(host=value)


def test_an_empty_host_in_the_environment_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_ROUTER_HOST", "")
    assert Settings().hosts() == ["127.0.0.1"]
    monkeypatch.setenv("LLAMA_ROUTER_HOST", "127.0.0.1,::1")
    assert Settings().hosts() == ["127.0.0.1", "::1"]


def test_url_host_brackets_ipv6() -> None:
    assert [url_host(h) for h in ("127.0.0.1", "::1", "localhost")] == \
        ["127.0.0.1", "[::1]", "localhost"]


def _answers(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family) as client:
        client.settimeout(5)
        return client.connect_ex((host, port)) == 0


@needs_ipv6
def test_every_address_is_bound_on_one_port() -> None:
    listeners = bind(["127.0.0.1", "::1"], 0)
    try:
        port = listeners.port
        assert port > 0
        assert listeners.urls == [f"http://127.0.0.1:{port}", f"http://[::1]:{port}"]
        assert _answers(socket.AF_INET, "127.0.0.1", port)
        assert _answers(socket.AF_INET6, "::1", port)
        # Several sockets: each IPv6 one is IPv6 only, so 0.0.0.0 and :: can coexist.
        v6 = listeners.sockets[1]
        assert v6.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
    finally:
        listeners.close()


@needs_ipv6
def test_a_lone_ipv6_wildcard_takes_ipv4_too() -> None:
    listeners = bind(["::"], 0)
    try:
        assert listeners.sockets[0].getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        assert _answers(socket.AF_INET, "127.0.0.1", listeners.port)
        assert _answers(socket.AF_INET6, "::1", listeners.port)
    finally:
        listeners.close()


def test_a_host_name_binds_each_address_it_resolves_to() -> None:
    listeners = bind(["localhost"], 0)
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo("localhost", 0,
                                                              type=socket.SOCK_STREAM)}
        assert len(listeners.sockets) == len(resolved)
        assert _answers(socket.AF_INET, "127.0.0.1", listeners.port) \
            or not any(":" not in ip for ip in resolved)
    finally:
        listeners.close()


def test_a_taken_address_is_refused_by_name_and_nothing_stays_bound() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenError) as refused:
            bind(["127.0.0.1", "127.0.0.2"], port)
        assert str(refused.value) == f"cannot listen on 127.0.0.2:{port}: Address already in use"
        assert isinstance(refused.value, ConfigurationError)  # the CLI: exit 2, the message
        # The first address, bound before the failure, was let go.
        with socket.socket() as again:
            again.bind(("127.0.0.1", port))


@pytest.mark.parametrize(("host", "reason"), [
    ("192.0.2.1", "Cannot assign requested address"),  # not an address of this machine
    ("no-such-host.invalid", ""),  # the resolver's words vary by system
])
def test_an_address_that_cannot_be_listened_on_says_why(host: str, reason: str) -> None:
    with pytest.raises(ListenError, match=rf"^cannot listen on {host}:\d+: {reason}"):
        bind(["127.0.0.1", host], 0)
