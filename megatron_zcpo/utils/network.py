"""Which local address other hosts reach this process at (the trainer's end of the weight-update group)."""

from __future__ import annotations

import ipaddress
import socket
from typing import Callable, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

MASTER_ADDRESS_KEY = "rollout.sglang.client.master_address"

Resolver = Callable[..., list]


def host_and_port(url: str) -> Tuple[str, int]:
    """``("node7", 30000)`` of ``"http://node7:30000"`` (port 80/443 by scheme when absent)."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    if not parts.hostname:
        raise ValueError(f"server URL {url!r} has no host")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def resolve(host: str, port: int, getaddrinfo: Optional[Resolver] = None) -> Tuple[int, str]:
    """``(address family, IP)`` of ``host``, IPv4 preferred (what a client connecting to it would use).

    ``getaddrinfo``: the name service to ask (default ``socket.getaddrinfo``).
    """
    infos = (getaddrinfo or socket.getaddrinfo)(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host} did not resolve")
    family, _, _, _, sockaddr = sorted(infos, key=lambda info: info[0] != socket.AF_INET)[0]
    return family, sockaddr[0]


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP) is a loopback address (127.0.0.0/8, ::1)."""
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def route_source_address(family: int, address: str, port: int) -> str:
    """The local IP the kernel's routing table picks to reach ``address``.

    Connecting a UDP socket only selects the route and the source address; no packet is sent.
    """
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, port))
        return probe.getsockname()[0]


def master_address_for(
    server_urls: Sequence[str], configured: Optional[str] = None, *, getaddrinfo: Optional[Resolver] = None
) -> str:
    """The address SGLang servers at ``server_urls`` can reach this host at, for the NCCL master.

    ``configured`` (the :data:`MASTER_ADDRESS_KEY` setting) wins when given; otherwise it is the
    local address of the route to the first server's host (the interface that reaches the
    servers, not whatever ``gethostbyname(gethostname())`` says, which is 127.0.1.1 on common
    /etc/hosts setups or another NIC on multi-NIC nodes). Raises ``ValueError`` naming the setting
    when the address is a loopback one while a server is on another host (the servers would wait
    for the group until it times out), or when a server's host does not resolve.
    """
    if not server_urls:
        raise ValueError("no SGLang server URLs to reach")
    servers: List[Tuple[str, int, int, str]] = []
    for url in server_urls:
        host, port = host_and_port(url)
        try:
            family, ip = resolve(host, port, getaddrinfo)
        except OSError as error:
            raise ValueError(f"SGLang server host {host!r} (of {url}) does not resolve: {error}") from None
        servers.append((url, port, family, ip))
    if configured:
        address, how = configured, f"{MASTER_ADDRESS_KEY}={configured!r}"
    else:
        _, port, family, ip = servers[0]
        address = route_source_address(family, ip, port)
        how = f"the local address of the route to {servers[0][0]} ({ip})"
    remote = [url for url, _, _, ip in servers if not is_loopback(ip)]
    if remote and _loopback_name(address, getaddrinfo):
        raise ValueError(
            f"weight-update master address {address} ({how}) is a loopback address, but SGLang "
            f"servers {remote} are on other hosts and could not reach it: set {MASTER_ADDRESS_KEY} "
            "to an address of this host on the servers' network"
        )
    return address


def _loopback_name(address: str, getaddrinfo: Optional[Resolver]) -> bool:
    try:
        return is_loopback(address)
    except ValueError:  # a host name: judge what it resolves to
        return is_loopback(resolve(address, 0, getaddrinfo)[1])
