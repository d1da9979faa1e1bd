"""rlx.ports: where engines bind and which key they require, on one node and across nodes."""

from __future__ import annotations

import re

from rlx import ports


def test_one_node_binds_loopback(monkeypatch):
    assert ports.network_env(1) == {}
    monkeypatch.delenv(ports.HOST_ENV, raising=False)
    monkeypatch.delenv(ports.API_KEY_ENV, raising=False)
    assert ports.engine_host() == "127.0.0.1"
    assert ports.api_key() is None and ports.auth_headers() == {}


def test_every_run_gets_a_fresh_key_and_across_nodes_binds_the_node(monkeypatch):
    assert ports.network_env(2) == ports.network_env(4) == {ports.HOST_ENV: "node"}  # no key in it
    first, second = ports.new_api_key(), ports.new_api_key()
    # secrets.token_urlsafe(32): 32 random bytes, 43 URL-safe base64 characters
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", first) and first != second

    monkeypatch.setattr(ports, "node_address", lambda: "10.1.2.3")
    monkeypatch.setenv(ports.HOST_ENV, "node")
    monkeypatch.setenv(ports.API_KEY_ENV, first)
    assert ports.engine_host() == "10.1.2.3"
    assert ports.api_key() == first
    assert ports.auth_headers() == {"Authorization": f"Bearer {first}"}
    assert ports.auth_headers("explicit") == {"Authorization": "Bearer explicit"}


def test_an_empty_key_is_no_key(monkeypatch):
    monkeypatch.setenv(ports.API_KEY_ENV, "")
    assert ports.api_key() is None and ports.auth_headers() == {}


def test_route_address_towards_loopback_is_loopback():
    assert ports.route_address("127.0.0.1") == "127.0.0.1"
