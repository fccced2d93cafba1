"""asyncgrpo.sync.gloo.address_toward: the address a server reaches the trainer's gloo store at."""

from __future__ import annotations

import socket

import pytest

from asyncgrpo.sync.gloo import address_toward


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000/v1"])
def test_a_server_on_this_host_reaches_the_loopback_address(url):
    assert address_toward(url) == "127.0.0.1"


def test_a_server_name_that_does_not_resolve_falls_back_to_loopback():
    assert address_toward("http://no-such-host.invalid:8000") == "127.0.0.1"


def test_a_server_on_another_host_gets_this_hosts_address_on_the_route_to_it():
    address = address_toward("http://192.0.2.1:8000")  # TEST-NET-1: routed, never answered
    if address == "127.0.0.1":
        pytest.skip("this machine has no route off the host")
    assert not address.startswith("127.")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((address, 0))  # only an address of this host binds
