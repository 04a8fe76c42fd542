"""`launcher.backends.ports.listen_socket`: the socket the HTTP front end binds itself (and the port
check before start-up) takes the address family uvicorn's own socket would, and a name with only an
IPv6 address still serves, as it did while uvicorn bound every address of the name."""

import socket

import pytest

from launcher.backends import ports
from launcher.backends.ports import listen_socket

REAL_GETADDRINFO = socket.getaddrinfo


def _fake_resolver(monkeypatch, names: dict[str, list[str]]) -> None:
    """Resolve each name of `names` to its addresses (in that order), like /etc/hosts would."""
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host not in names:
            return REAL_GETADDRINFO(host, port, family, type, proto, flags)
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port, 0, 0) if ":" in a else (a, port)) for a in names[host]
                if family in (0, socket.AF_INET6 if ":" in a else socket.AF_INET)]

    monkeypatch.setattr(ports.socket, "getaddrinfo", getaddrinfo)


def test_a_name_with_only_an_ipv6_address_listens_on_it(monkeypatch):
    """Was: an AF_INET socket bound to the name, socket.gaierror (serve: '--host ... does not
    resolve'), although the name resolves and uvicorn used to serve it."""
    _fake_resolver(monkeypatch, {"v6only.test": ["::1"]})
    with listen_socket("v6only.test", 0) as sock:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"
        with socket.create_connection(("::1", sock.getsockname()[1]), timeout=5):
            pass


def test_a_name_with_both_families_is_its_ipv4_address_and_literals_keep_theirs(monkeypatch):
    _fake_resolver(monkeypatch, {"both.test": ["::1", "127.0.0.1"]})
    with listen_socket("both.test", 0) as sock:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "127.0.0.1"
    for host, family in (("127.0.0.1", socket.AF_INET), ("", socket.AF_INET), ("::1", socket.AF_INET6),
                         ("::", socket.AF_INET6)):
        with listen_socket(host, 0) as sock:
            assert sock.family == family and sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
    with pytest.raises(socket.gaierror):
        listen_socket("no-such-host.invalid", 0)
