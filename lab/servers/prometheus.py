"""Real Prometheus (Debian 2.42) scraping test "nodes" whose traffic the test sets, plus a real
node_exporter for this machine.

    fake = FakeNodeExporters({"worker-a": 1e3, "worker-b": 1e5})    # bytes/s per fake node
    node_exporter = NodeExporter(tmp_dir)
    prom = PrometheusServer(tmp_dir, fake, node_exporter)
    prom.wait_for('count(node_uname_info)', at_least=3)            # poll, never sleep blindly
    fake.set_rate("worker-a", 5e6)

Each fake node is its own tiny HTTP server (its own `instance`, as a real node's exporter would
be), serving node_exporter's metric names in the text exposition format. Its byte counters are
advanced by rate x elapsed time whenever they are read, so Prometheus' rate() sees exactly the
rate the test set, and its link speed (node_network_speed_bytes) when given one. Every fake node
also reports busy `lo` and `veth` devices (the veth with a huge speed) that the default queries
must leave out. Prometheus logs every query it answers to `query_log` (JSON lines). Scrapes are every second; Prometheus needs ~6 s for its first scrape, so
start it once per session (`prometheus_stack` fixture) and poll.
"""
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler

import requests

from lab.httpd import BackgroundHTTPServer
from lab.procs import Server, free_port, require_binary

# Traffic on devices the default query excludes: if it leaked in, every ordering would break.
EXCLUDED_DEVICE_RATE = 5e9


class _Counter:
    """A byte counter whose rate can change: value(t) is continuous across rate changes."""

    def __init__(self, rate: float, now: float):
        self.rate = rate
        self._base = 0.0
        self._since = now

    def set_rate(self, rate: float, now: float) -> None:
        self._base = self.value(now)
        self._since = now
        self.rate = rate

    def value(self, now: float) -> float:
        return self._base + self.rate * (now - self._since)


class ExpositionServer:
    """Serves `self.exposition()` (Prometheus text format) on 127.0.0.1 to whoever scrapes."""

    def _serve(self) -> None:
        self.scrapes = 0
        self._server = BackgroundHTTPServer(self._handler())
        self.port = self._server.port

    def exposition(self) -> bytes:
        raise NotImplementedError

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                body = server.exposition()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def stop(self) -> None:
        self._server.stop()


class FakeNode(ExpositionServer):
    def __init__(self, nodename: str, rate: float, address: str, speed: float | None = None):
        self.nodename = nodename
        self.address = address          # the `instance` Prometheus gives it: "IP:9100"
        self.speed = speed              # eth0's node_network_speed_bytes; None: not reported
        now = time.monotonic()
        self._lock = threading.Lock()
        self._counters = {"eth0": _Counter(rate / 2, now),
                          "lo": _Counter(EXCLUDED_DEVICE_RATE, now),
                          "veth3f2a": _Counter(EXCLUDED_DEVICE_RATE, now)}
        self._serve()

    def set_rate(self, rate: float) -> None:
        """Total bytes/s (receive + transmit, half each) on the node's real interface."""
        with self._lock:
            self._counters["eth0"].set_rate(rate / 2, time.monotonic())

    def exposition(self) -> bytes:
        with self._lock:
            now = time.monotonic()
            values = {device: c.value(now) for device, c in self._counters.items()}
            self.scrapes += 1
        lines = [
            "# HELP node_uname_info Labeled system information as provided by the uname system call.",
            "# TYPE node_uname_info gauge",
            f'node_uname_info{{domainname="(none)",machine="x86_64",nodename="{self.nodename}",'
            f'release="6.1.0-28-cloud-amd64",sysname="Linux",version="#1 SMP Debian"}} 1',
        ]
        for direction in ("receive", "transmit"):
            lines.append(f"# HELP node_network_{direction}_bytes_total Network device statistic "
                         f"{direction}_bytes.")
            lines.append(f"# TYPE node_network_{direction}_bytes_total counter")
            for device, value in values.items():
                lines.append(f'node_network_{direction}_bytes_total{{device="{device}"}} {value:.1f}')
        lines += ["# HELP node_network_speed_bytes Network device property speed_bytes.",
                  "# TYPE node_network_speed_bytes gauge",
                  f'node_network_speed_bytes{{device="veth3f2a"}} {EXCLUDED_DEVICE_RATE * 100:.1f}']
        if self.speed is not None:
            lines.append(f'node_network_speed_bytes{{device="eth0"}} {self.speed:.1f}')
        return ("\n".join(lines) + "\n").encode()


class FakeNodeExporters:
    """Several fake nodes; addresses 10.0.<subnet>.1, .2... in the order given; `speeds`: link
    speed in bytes/s of the nodes that report one."""

    def __init__(self, rates: dict[str, float], speeds: dict[str, float] | None = None,
                 subnet: int = 0):
        self.nodes = {name: FakeNode(name, rate, f"10.0.{subnet}.{i}:9100", (speeds or {}).get(name))
                      for i, (name, rate) in enumerate(rates.items(), start=1)}

    def set_rate(self, nodename: str, rate: float) -> None:
        self.nodes[nodename].set_rate(rate)

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


class NodeExporter:
    """The real prometheus-node-exporter, reporting this machine."""

    def __init__(self, directory):
        binary = require_binary("prometheus-node-exporter")
        self.port = free_port()
        self.server = Server([binary, f"--web.listen-address=127.0.0.1:{self.port}",
                              "--no-collector.systemd"],
                             port=self.port, log_path=os.path.join(str(directory), "node-exporter.log"))

    def stop(self) -> None:
        self.server.stop()


class PrometheusServer:
    FAKE_JOB = "fake-nodes"
    LINKS_JOB = "links"
    NODE_JOB = "node"

    def __init__(self, directory, fake: FakeNodeExporters, node_exporter: NodeExporter | None = None,
                 links: FakeNodeExporters | None = None):
        self.binary = require_binary("prometheus")
        self.directory = str(directory)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = os.path.join(self.directory, "prometheus.yml")
        self.query_log = os.path.join(self.directory, "queries.log")
        # The fake nodes listen on 127.0.0.1:<port>; `instance` is relabelled to the address a
        # real node_exporter would have, so address matching can be tested too.
        scrape_configs = [{
            "job_name": job,
            "static_configs": [{"targets": [f"127.0.0.1:{n.port}"], "labels": {"instance": n.address}}
                               for n in group.nodes.values()],
        } for job, group in ((self.FAKE_JOB, fake), (self.LINKS_JOB, links)) if group is not None]
        if node_exporter is not None:
            scrape_configs.append({"job_name": self.NODE_JOB,
                                   "static_configs": [{"targets": [f"127.0.0.1:{node_exporter.port}"]}]})
        with open(self.config_path, "w") as f:
            json.dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                                  "scrape_timeout": "1s", "query_log_file": self.query_log},
                       "scrape_configs": scrape_configs}, f)  # JSON is YAML
        self.http = requests.Session()
        self.http.trust_env = False
        self.server: Server | None = None
        self.start()

    def start(self) -> None:
        self.server = Server([
            self.binary, f"--config.file={self.config_path}",
            f"--storage.tsdb.path={os.path.join(self.directory, 'data')}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ], port=self.port, log_path=os.path.join(self.directory, "prometheus.log"))

    @property
    def running(self) -> bool:
        return self.server is not None and self.server.proc.poll() is None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def logged_queries(self) -> list[str]:
        """Every query Prometheus answered so far, from its query log."""
        try:
            with open(self.query_log, encoding="utf-8") as f:
                # A line without its newline is still being written.
                return [json.loads(line)["params"]["query"] for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    def query(self, promql: str) -> list:
        r = self.http.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def wait_for(self, promql: str, *, at_least: int = 1, timeout: float = 30.0,
                 check=None) -> list:
        """Poll an instant query until it returns `at_least` series (and `check(result)` holds)."""
        end = time.monotonic() + timeout
        result = []
        while time.monotonic() < end:
            try:
                result = self.query(promql)
            except requests.RequestException:
                result = []
            if len(result) >= at_least and (check is None or check(result)):
                return result
            time.sleep(0.25)
        raise TimeoutError(f"{promql!r} gave {result!r} after {timeout} s; log:\n{self.server.log() if self.server else ''}")


def short_window(query: str, window: str = "4s", job: str = PrometheusServer.FAKE_JOB) -> str:
    """A default query with a short rate() window (so a rate change shows within seconds)
    restricted to one scrape job."""
    return query.replace("$window", window).replace('{device!~', f'{{job="{job}",device!~')


class PrometheusStack:
    def __init__(self, fake, node_exporter, prometheus, links):
        self.fake = fake
        self.links = links
        self.node_exporter = node_exporter
        self.prometheus = prometheus


FAKE_RATES = {"worker-a": 2e3, "worker-b": 2e5, "worker-c": 2e7}
# Job "links": nodes with link speeds (bytes/s; 100 Mb/s = 12.5e6), scored by utilisation.
LINK_RATES = {"slow-busy": 2e6, "fast-light": 9e6, "nospeed-quiet": 1e4, "nospeed-busy": 5e7,
              "equal-1": 2.5e6, "equal-2": 2.5e6, "equal-3": 2.5e6}
LINK_SPEEDS = {"slow-busy": 12.5e6, "fast-light": 3.125e9,
               "equal-1": 125e6, "equal-2": 125e6, "equal-3": 125e6}


class CannedPrometheusHttp:
    """Fault injection only: a fixed Prometheus answer instead of a network (the poller's
    `http`), counting the calls."""

    def __init__(self):
        self.calls = 0

    def get(self, url, **kwargs):
        from archway.registry.http import Response
        self.calls += 1
        body = {"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"nodename": "a", "archway_series": "traffic"}, "value": [1, "42"]}]}}
        return Response(200, {}, json.dumps(body).encode(), url)
