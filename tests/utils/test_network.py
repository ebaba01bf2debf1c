"""The weight-update group's master address: the route to the servers, never a loopback address for remote servers."""

import socket

import pytest

from megatron_zcpo.utils import network


def fake_resolver(table):
    """A getaddrinfo over ``{host: ip}`` (IPv4), so no name service is asked."""

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in table:
            raise socket.gaierror(f"unknown host {host}")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], port))]

    return getaddrinfo


def test_route_source_of_a_loopback_destination_is_loopback():
    assert network.route_source_address(socket.AF_INET, "127.0.0.1", 30000) == "127.0.0.1"


def test_the_route_to_the_first_servers_host_decides(monkeypatch):
    routes = []
    monkeypatch.setattr(
        network, "route_source_address", lambda family, ip, port: routes.append((ip, port)) or "10.1.0.5"
    )
    # What gethostbyname(gethostname()) says on a Debian /etc/hosts is not consulted.
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    resolver = fake_resolver({"gpu-node-7": "10.1.0.7", "gpu-node-8": "10.1.0.8"})
    address = network.master_address_for(["http://gpu-node-7:30000", "http://gpu-node-8:30010"], getaddrinfo=resolver)
    assert address == "10.1.0.5" and routes == [("10.1.0.7", 30000)]


def test_servers_on_this_host_may_use_loopback():
    resolver = fake_resolver({"localhost": "127.0.0.1", "this-node": "127.0.1.1"})
    assert (
        network.master_address_for(["http://localhost:31000", "http://this-node:31010"], getaddrinfo=resolver)
        == "127.0.0.1"
    )


@pytest.mark.parametrize(
    "configured,route", [(None, "127.0.1.1"), ("127.0.0.1", "10.1.0.5"), ("localhost", "10.1.0.5")]
)
def test_a_loopback_address_for_remote_servers_is_refused_naming_the_setting(monkeypatch, configured, route):
    monkeypatch.setattr(network, "route_source_address", lambda family, ip, port: route)
    resolver = fake_resolver({"gpu-node-7": "10.1.0.7", "localhost": "127.0.0.1"})
    with pytest.raises(ValueError, match=r"loopback address.*gpu-node-7.*set rollout\.sglang\.client\.master_address"):
        network.master_address_for(["http://gpu-node-7:30000"], configured, getaddrinfo=resolver)


def test_a_configured_address_wins_and_bad_hosts_are_named():
    resolver = fake_resolver({"gpu-node-7": "10.1.0.7"})
    assert network.master_address_for(["http://gpu-node-7:30000"], "10.2.0.1", getaddrinfo=resolver) == "10.2.0.1"
    with pytest.raises(ValueError, match="'nowhere' .* does not resolve"):
        network.master_address_for(["http://nowhere:30000"], getaddrinfo=resolver)
    with pytest.raises(ValueError, match="has no host"):
        network.host_and_port("http://:30000")
    assert network.host_and_port("node1:8000") == ("node1", 8000)
