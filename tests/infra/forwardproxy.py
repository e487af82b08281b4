"""A real forward (egress) proxy for tests: Debian's tinyproxy on loopback.

    proxy = ForwardProxy(tmp_dir)
    ... HTTPS_PROXY=proxy.url ...
    proxy.requests()     # [("CONNECT", "127.0.0.1:5000"), ("GET", "http://..."), ...] from its log

Every port may be tunnelled (no ConnectPort lines), only 127.0.0.1 may use it.
"""
import os
import re
import time

from lab.procs import Server, free_port, require_binary

_REQUEST = re.compile(r"Request \(file descriptor \d+\): (?P<method>[A-Z]+) (?P<target>\S+) HTTP/")


class ForwardProxy:
    def __init__(self, directory):
        binary = require_binary("tinyproxy")
        self.directory = str(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.port = free_port()
        self.log_path = os.path.join(self.directory, "tinyproxy.log")
        config = os.path.join(self.directory, "tinyproxy.conf")
        with open(config, "w") as f:
            f.write(f"Port {self.port}\nListen 127.0.0.1\nAllow 127.0.0.1\nLogLevel Info\n"
                    f'LogFile "{self.log_path}"\nMaxClients 50\nTimeout 30\n'
                    f"DisableViaHeader Yes\n")
        self.server = Server([binary, "-d", "-c", config], port=self.port,
                             log_path=os.path.join(self.directory, "stderr.log"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self, settle: float = 0.2) -> list[tuple[str, str]]:
        """(method, target) of every request the proxy received so far."""
        time.sleep(settle)   # tinyproxy logs as it goes; give the last line a moment
        if not os.path.exists(self.log_path):
            return []
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return [(m["method"], m["target"]) for m in map(_REQUEST.search, f) if m]

    def stop(self) -> None:
        self.server.stop()
