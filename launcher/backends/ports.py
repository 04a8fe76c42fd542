"""TCP addresses of the launcher: `host:port` strings and free-port probing for test servers.

Owns how a gRPC address is written (IPv6 literals in brackets) and how a free port for a
test server is found. Must not: spawn processes or open long-lived sockets.
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
