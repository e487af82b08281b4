"""A 5,000-node cluster for the extender figures: Node objects as the API server serves them, and
their network traffic in a real Prometheus.

Nodes are copies of the first node of tests/fixtures/extender/filter-nodes.json (a real EKS
node as the scheduler sends it) with their own name, addresses, arch (half amd64, half arm64)
and kubelet's maximum of 50 entries in status.images, about 13 KB each, the size the extender's
own notes give for real clusters.

Prometheus scrapes one exporter that speaks for every node: each series carries its node's
`instance` (its InternalIP:9100) and `honor_labels: true` keeps it, so the default archway query
joins traffic to node_uname_info per instance exactly as with one node_exporter per node.
"""
import copy
import json
import os
import time

import requests

from lab.procs import REPO, Server, free_port, require_binary
from lab.servers.prometheus import ExpositionServer

NODES = 5000
IMAGES_PER_NODE = 50     # kubelet's default nodeStatusMaxImages


def _template() -> dict:
    with open(os.path.join(REPO, "tests", "fixtures", "extender", "filter-nodes.json")) as f:
        return json.load(f)


def node_name(i: int) -> str:
    return f"ip-10-1-{i // 250}-{i % 250 + 1}.eu-west-1.compute.internal"


def node_address(i: int) -> str:
    return f"10.1.{i // 250}.{i % 250 + 1}"


def make_nodes(count: int = NODES) -> list[dict]:
    template = _template()["Nodes"]["items"][0]
    images = template["status"]["images"]
    many_images = [
        {"names": [f"{entry['names'][0].split('@')[0]}-{k}@sha256:{k:064x}",
                   f"{entry['names'][-1].rsplit(':', 1)[0]}-{k}:v1.{k}"],
         "sizeBytes": entry["sizeBytes"] + k}
        for k, entry in ((k, images[k % len(images)]) for k in range(IMAGES_PER_NODE))]
    nodes = []
    for i in range(count):
        node = copy.deepcopy(template)
        name, address, arch = node_name(i), node_address(i), ("amd64", "arm64")[i % 2]
        meta = node["metadata"]
        meta["name"] = name
        meta["uid"] = f"c13598a5-dc9b-6ad9-4ce9-{i:012x}"
        meta["labels"].update({"kubernetes.io/arch": arch, "beta.kubernetes.io/arch": arch,
                               "kubernetes.io/hostname": name.split(".")[0]})
        meta["annotations"]["projectcalico.org/IPv4Address"] = f"{address}/20"
        node["spec"]["providerID"] = f"aws:///eu-west-1a/i-{i:017x}"
        node["spec"]["podCIDR"] = f"192.168.{i % 256}.0/24"
        node["spec"]["podCIDRs"] = [node["spec"]["podCIDR"]]
        node["status"]["addresses"] = [{"type": "InternalIP", "address": address},
                                       {"type": "InternalDNS", "address": name},
                                       {"type": "Hostname", "address": name}]
        node["status"]["nodeInfo"]["architecture"] = arch
        node["status"]["images"] = copy.deepcopy(many_images)
        nodes.append(node)
    return nodes


def extender_pod(architectures: str = "amd64") -> dict:
    """The fixture's pod, annotated by the webhook with the architectures of its images."""
    pod = _template()["Pod"]
    pod["metadata"]["annotations"]["archway.dev/architectures"] = architectures
    return pod


def link_speed(i: int) -> float | None:
    """node_network_speed_bytes of node i's eth0: 100 Mb/s, 1 Gb/s, 10 Gb/s, 25 Gb/s, or none
    (every fifth node: scored by its traffic rank)."""
    return (12.5e6, 125e6, 1.25e9, 3.125e9, None)[i % 5]


def running_pods(count: int = NODES) -> list[dict]:
    """One running pod per node, as the pod watch lists them (only what it reads)."""
    return [{"metadata": {"name": f"app-{i}", "namespace": "bench", "uid": f"pod-uid-{i:08d}"},
             "spec": {"nodeName": node_name(i), "containers": [{"name": "app", "image": "app:1"}]},
             "status": {"phase": "Running"}} for i in range(count)]


def traffic_rate(i: int) -> float:
    """Bytes/s of node i: spread over four orders of magnitude, so scores use 0..10."""
    return 1e3 * 10 ** ((i * 7919 % NODES) / NODES * 4)


class ManyNodesExporter(ExpositionServer):
    """One HTTP exporter serving node_exporter's series for every node, each with its own
    `instance` label; the byte counters advance at traffic_rate(i) per second."""

    def __init__(self, count: int = NODES):
        self.started = time.monotonic()
        self.rates = [traffic_rate(i) / 2 for i in range(count)]   # receive and transmit halves
        self.uname = "".join(
            f'node_uname_info{{instance="{node_address(i)}:9100",nodename="{node_name(i).split(".")[0]}",'
            f'machine="x86_64",sysname="Linux"}} 1\n' for i in range(count))
        self.prefixes = [(f'node_network_receive_bytes_total{{instance="{node_address(i)}:9100",device="eth0"}} ',
                          f'node_network_transmit_bytes_total{{instance="{node_address(i)}:9100",device="eth0"}} ')
                         for i in range(count)]
        self.speeds = "".join(
            f'node_network_speed_bytes{{instance="{node_address(i)}:9100",device="eth0"}} {speed:.0f}\n'
            for i, speed in ((i, link_speed(i)) for i in range(count)) if speed is not None)
        self._serve()

    def exposition(self) -> bytes:
        elapsed = time.monotonic() - self.started
        lines = ["# TYPE node_uname_info gauge\n", self.uname,
                 "# TYPE node_network_receive_bytes_total counter\n"]
        lines += [f"{rx}{rate * elapsed:.1f}\n" for (rx, _), rate in zip(self.prefixes, self.rates)]
        lines.append("# TYPE node_network_transmit_bytes_total counter\n")
        lines += [f"{tx}{rate * elapsed:.1f}\n" for (_, tx), rate in zip(self.prefixes, self.rates)]
        lines += ["# TYPE node_network_speed_bytes gauge\n", self.speeds]
        self.scrapes += 1
        return "".join(lines).encode()


class Prometheus:
    """Debian's prometheus scraping the ManyNodesExporter every 2 s."""

    def __init__(self, directory: str, exporter: ManyNodesExporter):
        os.makedirs(directory, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = os.path.join(directory, "prometheus.yml")
        with open(config, "w") as f:
            json.dump({"global": {"scrape_interval": "2s", "scrape_timeout": "2s",
                                  "evaluation_interval": "2s"},
                       "scrape_configs": [{"job_name": "nodes", "honor_labels": True,
                                           "static_configs": [{"targets": [
                                               f"127.0.0.1:{exporter.port}"]}]}]}, f)
        self.server = Server([require_binary("prometheus"), f"--config.file={config}",
                              f"--storage.tsdb.path={os.path.join(directory, 'data')}",
                              f"--web.listen-address=127.0.0.1:{self.port}"],
                             port=self.port, log_path=os.path.join(directory, "prometheus.log"))
        self.http = requests.Session()
        self.http.trust_env = False

    def wait_for(self, query: str, at_least: int, timeout: float = 60.0) -> int:
        """Poll an instant query until it returns `at_least` series; returns how many."""
        end = time.monotonic() + timeout
        count = 0
        while time.monotonic() < end:
            try:
                r = self.http.get(f"{self.url}/api/v1/query", params={"query": query}, timeout=10)
                count = len(r.json()["data"]["result"])
            except (requests.RequestException, ValueError, KeyError):
                count = 0
            if count >= at_least:
                return count
            time.sleep(0.5)
        raise TimeoutError(f"{query!r} returned {count} series after {timeout} s; "
                           f"log:\n{self.server.log()}")

    def stop(self) -> None:
        self.http.close()
        self.server.stop()
