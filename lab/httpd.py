"""A threaded HTTP(S) server on 127.0.0.1, served from a daemon thread: what the stand-ins in
tests run on (the API server, the token service, the file server, scripted fault servers,
metrics expositions)."""
import ssl
import threading
from http.server import ThreadingHTTPServer


class BackgroundHTTPServer:
    def __init__(self, handler, *, tls=None, server_class=ThreadingHTTPServer):
        """`handler`: a BaseHTTPRequestHandler class; `tls`: a certificate pair (chain_path,
        key_path) to serve HTTPS with, TLS 1.2 or newer. The port is the kernel's choice."""
        self.httpd = server_class(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(tls.chain_path, tls.key_path)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port: int = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
