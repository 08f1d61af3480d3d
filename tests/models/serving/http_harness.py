"""What the server tests share: an HTTP client, and a `Server` run by uvicorn on a free port of
this host in a thread, with its /metrics read back."""

import socket
import threading
import time

import httpx
import uvicorn

from models.serving.server import Server

HTTP = httpx.Client(timeout=120, limits=httpx.Limits(max_keepalive_connections=0))
"""The tests' HTTP client: a first request may wait for a compile, past httpx's 5 s default;
each request on a fresh connection, as `httpx.post` makes one (a server that drops a connection
after a 500 must not fail the next request)."""


class Listening:
    """`server` (its engine started) answering at `url` until `close`."""

    def __init__(self, server: Server):
        self.server = server
        server.engine.start()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning")
        self.http = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.http.run, daemon=True)
        self.thread.start()
        while not self.http.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"

    def metric(self, name: str) -> float:
        """One value of the server's /metrics."""
        lines = HTTP.get(f"{self.url}/metrics").text.splitlines()
        return float(next(line.split()[1] for line in lines if line.startswith(name + " ")))

    def close(self) -> None:
        self.http.should_exit = True
        self.thread.join(10)
        self.server.drain(0.0)
