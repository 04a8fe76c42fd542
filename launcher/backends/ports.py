"""TCP addresses of the launcher: `host:port` strings, free-port probing for test servers, and the
listening socket of a front end.

Owns how a gRPC address is written (IPv6 literals in brackets), how a free port for a test server
is found, and how a server's port is bound (`listen_socket`: the same for the check before start-up
and for the HTTP server itself). Must not: spawn processes or keep a socket itself (the caller owns
what `listen_socket` returns).
"""

from __future__ import annotations

import socket


def format_address(host: str, port: int) -> str:
    """`host:port`, with brackets around an IPv6 literal (`[::1]:50051`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bind port 0, read it back, close).

    Another process may take the port before it is used: the data-plane rendezvous holds its port
    instead (`workers.channel.hold_listener`); this serves tests and benchmarks that start servers.
    """
    family, socktype, proto, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socktype, proto) as sock:
        sock.bind(sockaddr)
        return int(sock.getsockname()[1])


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: any free one), bound as uvicorn binds its own: IPv6
    for an address with ":" (`::` dual-stack where the system allows), else IPv4, so `localhost` is
    127.0.0.1 even where it lists ::1 first; a name with no IPv4 address, its IPv6 one. SO_REUSEADDR,
    so a port in TIME_WAIT after a previous server is not refused. The caller closes it. Raises
    socket.gaierror if `host` does not resolve, OSError (EADDRINUSE, EACCES, ...) if it cannot listen."""
    family, address = _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def _address(host: str, port: int) -> tuple[int, tuple]:
    """(family, address) that `listen_socket` binds: "" is every IPv4 interface; an IPv6 literal its
    own; a name its first IPv4 address, else (a host with only IPv6 ones) its first IPv6 address."""
    if not host:
        return socket.AF_INET, ("", port)
    infos = socket.getaddrinfo(host, port, socket.AF_INET6 if ":" in host else socket.AF_UNSPEC, socket.SOCK_STREAM)
    family, _, _, _, address = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    return family, address
