"""A TCP proxy on loopback that adds latency or stops answering, in front of a real server.

Fault injection only: the server behind it is real. `delay` is added before each chunk the
server sends back (so every HTTP response costs at least that; changing it affects open
connections too, as a registry that slows down or recovers would), `hang = True` accepts
connections and never forwards a byte, `go_down()` / `come_back()` refuse connections for a while.
"""
import socket
import threading
import time

from lab.procs import free_port


class DelayProxy:
    def __init__(self, target_port: int, *, delay: float = 0.0, hang: bool = False):
        self.target_port = target_port
        self.delay = delay
        self.hang = hang
        self.refuse = False   # True: every new connection is closed at once (a server that is down)
        self.connections = 0
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._stopping = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self):
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            if self.refuse:
                client.close()
                continue
            self._sockets.append(client)
            if self.hang:
                continue  # keep the socket open, never answer
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets.append(upstream)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, delayed: bool):
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if delayed and self.delay:
                    time.sleep(self.delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def go_down(self) -> None:
        """Refuse new connections and cut the open ones, as a registry that went down."""
        self.refuse = True
        sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def come_back(self) -> None:
        self.refuse = False

    def stop(self):
        self._stopping = True
        self._listener.close()
        for s in self._sockets:
            s.close()
