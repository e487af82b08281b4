"""Figure 21: peak memory of one extender worker fed bodies at the 64 MiB cap, in both shapes.

`archway serve --product extender` (1 worker, plain HTTP, as the chart's sidecar) gets, in turn:
64 MiB of short NodeNames (5.6 million names) and 64 MiB of tiny Node objects (2 million), both
past MAX_CANDIDATE_NODES; then NodeNames at the cap (65,536 names of 253 characters) to filter
and to prioritize, and 65,536 Node objects padded to 60 MB, every one passing (the reply echoes
them all). Measured: the worker's VmHWM (peak resident memory) from /proc, after all of them.
"""
import json
import time

from archway.extender.wire import MAX_CANDIDATE_NODES
from bench.common.extender_cluster import extender_pod
from bench.common.lab import Lab
from bench.common.report import Figure
from bench.common.section import Started, measured
from bench.common.servers import GunicornServer

TARGET_MB = 512
LONGEST_NAME = 253   # a Node's name is a DNS subdomain
MB = 1024 * 1024
CAP = 64 * MB
SPEC = ("21", "extender worker peak RSS, bodies at the 64 MiB cap, both shapes", f"< {TARGET_MB} MB")


def run(lab: Lab) -> list[Figure]:
    return measured([SPEC], lambda started: _measure(lab, started))


def _measure(lab: Lab, started: Started) -> list[Figure]:
    number, name, target = SPEC
    config = lab.archway_config("bodies", server={"tls": False, "cert_file": None,
                                                  "key_file": None, "workers": 1})
    server = started(GunicornServer.archway(lab.path("bodies"), config, tls_ca=None,
                                            name="bodies"))
    worker, = server.wait_workers(1)
    before = _peak(worker)
    pod = extender_pod("amd64")
    answers = []
    for label, verb, body in _bodies(pod):
        began = time.monotonic()
        r = server.post(f"/scheduler/{verb}", body, timeout=120)
        answers.append(f"{label} ({len(body) / MB:.0f} MiB) {verb}: {r.status_code} in "
                       f"{time.monotonic() - began:.1f} s")
        if r.status_code not in (200, 413):
            raise RuntimeError(f"{label}: HTTP {r.status_code}: {r.text[:200]}")
        del body, r
    peak = _peak(worker)
    if server.worker_pids() != [worker]:
        raise RuntimeError("the worker was replaced during the measurement")
    return [Figure(number, name, f"{peak / MB:.0f} MB ({before / MB:.0f} MB before)", target,
                   peak < TARGET_MB * MB, [
        "VmHWM of the one worker of `archway serve --product extender` (plain HTTP) after: "
        + "; ".join(answers),
        f"past {MAX_CANDIDATE_NODES:,} candidate nodes a body is a 413 as soon as the parser "
        f"has counted them; before that limit the first two took the worker to 0.9 and 1.2 GB",
    ])]


def _bodies(pod: dict):
    def encoded(**shape) -> bytes:
        return json.dumps({"Pod": pod, **shape}, separators=(",", ":")).encode()

    yield "short NodeNames", "filter", encoded(
        Nodes=None, NodeNames=[f"n{i:08d}" for i in range(CAP // 12 - 1000)])
    yield "tiny Nodes", "filter", encoded(NodeNames=None, Nodes={"items": [
        {"metadata": {"name": f"n{i:08d}"}} for i in range(CAP // 34 - 1000)]})
    longest = encoded(Nodes=None, NodeNames=[f"n{i:08d}".ljust(LONGEST_NAME, "x")
                                             for i in range(MAX_CANDIDATE_NODES)])
    yield "65,536 longest NodeNames", "filter", longest
    yield "65,536 longest NodeNames", "prioritize", longest
    del longest
    yield "65,536 padded Nodes", "filter", encoded(NodeNames=None, Nodes={"items": [
        {"metadata": {"name": f"n{i:08d}", "annotations": {"a": "y" * 880}}}
        for i in range(MAX_CANDIDATE_NODES)]})


def _peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
