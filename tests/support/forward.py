"""A TCP forwarder: pods on the real node reach the test control plane's API server through it.

The API server of :mod:`tests.support.kube` listens on 127.0.0.1 only, which a pod (its own network
namespace) cannot reach, and no kube-proxy routes the ``kubernetes`` Service's ClusterIP here. The node's
bridge address is the host as pods see it: this forwards one port of that address to the API server,
byte for byte (TLS passes through; the serving certificate names the bridge address). Nothing else on
the machine can reach it unless it can reach the bridge, and it ends with the test.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class Forwarder:
    """Accept on ``listen`` (host, port) and copy each connection to and from ``target``."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen, self.target = listen, target
        self._server = socket.create_server(listen, reuse_port=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="api-forward", daemon=True)

    def start(self) -> Forwarder:
        self._thread.start()
        return self

    def _accept(self) -> None:
        self._server.settimeout(0.5)
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=30)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        ends = {client: upstream, upstream: client}
        with selectors.DefaultSelector() as selector, client, upstream:
            for end in ends:
                selector.register(end, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.5):
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        data = source.recv(65536)
                        if not data:
                            return
                        ends[source].sendall(data)
                    except OSError:
                        return

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._server.close()
        self._thread.join(5)
