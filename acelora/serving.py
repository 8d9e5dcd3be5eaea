"""Run an ASGI app with uvicorn in a background thread on a loopback port (demo, examples, tests)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


class BackgroundServer:
    """``with BackgroundServer(app) as srv: srv.url`` — a real uvicorn server on 127.0.0.1, any free port.

    >>> with BackgroundServer(app) as srv:  # doctest: +SKIP
    ...     httpx.get(srv.url + "/healthz")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 start_timeout_s: float = 30.0, lifespan: str = "auto") -> None:
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.app = app
        config = uvicorn.Config(app, log_level=log_level, lifespan=lifespan, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                        name=f"uvicorn-{self.port}")
        self._start_timeout_s = start_timeout_s

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
