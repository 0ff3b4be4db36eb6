"""The suite's S3 server (helpers/s3_server.py) starts although a port it drew is taken before weed
binds it: CI lost a run to that (another lane's server held one of them)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import s3_server
from s3_server import S3Server


def listening_on(port: int) -> socket.socket:
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the stopped server's TIME_WAITs
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


def test_a_first_start_whose_port_was_taken_starts_on_other_ports(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        taken = probe.getsockname()[1]
    holder = listening_on(taken)
    draws = iter([taken])
    real_free_port = s3_server.free_port
    # The first port drawn (the master's) is held by someone else by the time weed binds it.
    monkeypatch.setattr(s3_server, "free_port", lambda: next(draws, None) or real_free_port())
    server = None
    try:
        server = S3Server()
        assert taken not in [port for pair in server.ports.values() for port in pair]
        assert f"Port allocation failed: port {taken}" in server.log.read_text()  # it clashed, and started anyway
    finally:
        holder.close()
        if server is not None:
            server.stop(keep_data=False)


def test_a_restart_waits_for_its_own_ports_and_says_when_they_stay_taken(monkeypatch):
    server = S3Server()
    try:
        url = server.url
        server.stop()
        logged = len(server.log.read_bytes())
        holder = listening_on(server.ports["s3"][0])  # taken for a moment, as a free_port() probe does
        threading.Thread(target=lambda: (time.sleep(1.0), holder.close()), daemon=True).start()
        server.start()
        assert server.url == url  # the tests hold the URL: a restart keeps its ports (start() waited for a round trip)
        assert any(clash in server.log.read_bytes()[logged:].decode() for clash in s3_server.CLASHES)

        server.stop()
        monkeypatch.setattr(s3_server, "RESTART_PAUSE", 0.01)
        monkeypatch.setattr(s3_server, "BIND_TRIES", 2)
        holder = listening_on(server.ports["s3"][0])
        try:
            with pytest.raises(s3_server.PortTaken, match=r"Port allocation failed|address already in use"):
                server.start()
        finally:
            holder.close()
    finally:
        server.stop(keep_data=False)
