"""Figures 10 and 11: gate on a miss.

10: release latency after the registry comes back. 100 pods (10 images x 10 pods) are admitted
    through `archway serve` (gate mode, the stand-in API) while the registry is down (a proxy
    refuses connections): all are gated. The proxy then lets connections through again; each
    pod's latency is from that instant to the moment the stand-in holds it released (polled
    every 5 ms). 10b: the same with a registry that was slow (every response delayed past the
    deadline and the read timeout) and is fast again: lookups already in flight must time out.
11: warm-cache admission throughput with the gate controller running and busy (the 100 pods
    gated again, retrying against a registry that stays slow) vs the same server build with no
    Kubernetes API (no controller), wrk rounds alternating between the two.
"""
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from bench.common.lab import PLATFORMS, Lab, fixture_text, mutated_archs
from bench.common.loadgen import run_wrk
from bench.common.report import Figure
from bench.common.rounds import interleaved, ratios, rounds
from bench.common.section import Started, measured
from bench.common.servers import GunicornServer, rss_bytes
from bench.common.stats import median, parse_metrics, percentile
from lab.servers.apiserver import FakeApiServer
from lab.servers.proxy import DelayProxy
from lab.servers.registry import RegistryServer

PODS = 100
IMAGES = 10
SLOW_SECONDS = 4.0        # per response chunk: far past the deadline and the registry timeout
DEADLINE = 1.0
P99_TARGET_SECONDS = 2.0
SECONDS = 3
CONNECTIONS = 16
RATIO_TARGET = 0.9
NS = "shop"


def run(lab: Lab) -> list[Figure]:
    specs = (("13", f"release latency of {PODS} gated pods after the registry comes back",
              f"p99 < {P99_TARGET_SECONDS:g} s"),
             ("13b", f"release latency of {PODS} gated pods after the registry is fast again",
              "context for 13"),
             ("14", "warm-cache admission throughput, gate controller busy vs no controller",
              f">= {RATIO_TARGET}"))

    def measure(started: Started) -> list[Figure]:
        registry = started(RegistryServer(lab.path("registry-gate"), ca=lab.ca))
        registry.push_index("archway/multi", "1.0", list(PLATFORMS))
        for i in range(IMAGES):
            for repo in ("archway/gated", "archway/slow"):
                registry.push_index(repo, f"v{i}", ["linux/amd64", "linux/arm64"])
        proxy = started(DelayProxy(registry.port))
        api = started(FakeApiServer())
        api.put(f"/api/v1/namespaces/{NS}/serviceaccounts/default", {
            "kind": "ServiceAccount", "apiVersion": "v1",
            "metadata": {"name": "default", "namespace": NS}})
        gated = started(GunicornServer.archway(lab.path("gate"), lab.archway_config(
            "gate", admission={"deadline_seconds": DEADLINE, "unresolved": "gate",
                               "gate_max_seconds": 600},
            registry={"timeout_seconds": 1.5},
            kubernetes={"enabled": "auto", "kubeconfig": api.kubeconfig(lab.path("kube")),
                        "namespace": "archway"}), tls_ca=lab.ca.cert_path, name="gated"))
        plain = started(GunicornServer.archway(lab.path("gate"), lab.archway_config("plain"),
                                               tls_ca=lab.ca.cert_path, name="no-controller"))
        _wait_leader(gated)
        slow_images = [f"{proxy.host}/archway/gated:v{i % IMAGES}" for i in range(PODS)]
        release = _release_latency(gated, api, proxy, slow_images, "a", down=True)
        slow_release = _release_latency(gated, api, proxy,
                                         [image.replace("/gated:", "/slow:") for image in slow_images],
                                         "s", down=False)
        warm = fixture_text("v1-pod-multiarch.json").replace("REGISTRY", registry.host).encode()
        throughput = _throughput(gated, plain, api, proxy, warm,
                                 [image.replace(":v", ":w") for image in slow_images])
        return [release, slow_release, throughput]
    return measured(specs, measure)


def _wait_leader(server: GunicornServer, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        answers = [server.session.get(server.url("/readyz"), timeout=5).json() for _ in range(6)]
        if all(a.get("gate_controller") == "leader alive" for a in answers):
            return
        time.sleep(0.2)
    raise RuntimeError("the gate controller never led")


def _review(name: str, image: str) -> bytes:
    review = json.loads(fixture_text("v1-pod-multiarch.json"))
    review["request"].update(uid=str(uuid.uuid4()), namespace=NS, name=name)
    pod = review["request"]["object"]
    pod["metadata"] = {"name": name, "namespace": NS}
    pod["spec"]["containers"] = [dict(pod["spec"]["containers"][0], image=image)]
    return json.dumps(review).encode()


def _admit_gated(server: GunicornServer, api: FakeApiServer, images: list[str],
                 prefix: str) -> list[str]:
    """Create the pods as the apiserver would (webhook patch applied, pod stored); all gated."""
    import base64

    import jsonpatch

    def create(i: int) -> str:
        name = f"{prefix}-{i}"
        body = _review(name, images[i])
        answer = server.post("/mutate", body).json()["response"]
        pod = json.loads(body)["request"]["object"]
        if "patch" in answer:
            pod = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(answer["patch"])))
        if not any(g["name"] == "archway.dev/resolving" for g in pod["spec"].get("schedulingGates", [])):
            raise RuntimeError(f"pod {name} was not gated: {answer}")
        api.put(f"/api/v1/namespaces/{NS}/pods/{name}", pod)
        return name

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(create, range(len(images))))


def _gated_now(server: GunicornServer) -> float:
    return sum(v for name, _, v in parse_metrics(server.metrics()) if name == "archway_gated_pods")


def _release_latency(server, api, proxy, images, prefix, *, down: bool) -> Figure:
    """All pods gated while the registry is down (connections refused) or slow, then it comes
    back; each pod timed from that instant until the stand-in holds it released."""
    if down:
        proxy.go_down()
    else:
        proxy.delay = SLOW_SECONDS
    names = _admit_gated(server, api, images, prefix)
    end = time.monotonic() + 60
    while _gated_now(server) < len(names):
        if time.monotonic() > end:
            raise RuntimeError("the controller never saw every gated pod")
        time.sleep(0.1)
    time.sleep(3.0)   # the controller has failed several attempts: it is in its back-off
    paths = {name: f"/api/v1/namespaces/{NS}/pods/{name}" for name in names}
    released: dict[str, float] = {}
    back = time.monotonic()
    if down:
        proxy.come_back()
    else:
        proxy.delay = 0.0
    end = back + 30
    while len(released) < len(names) and time.monotonic() < end:
        now = time.monotonic()
        for name, path in paths.items():
            if name not in released:
                pod = api.get(path)
                if not pod["spec"].get("schedulingGates"):
                    released[name] = now - back
        time.sleep(0.005)
    if len(released) < len(names):
        raise RuntimeError(f"only {len(released)} of {len(names)} pods released within 30 s")
    placed = sum(1 for path in paths.values()
                 if "kubernetes.io/arch" in json.dumps(api.get(path)["spec"]))
    latencies = sorted(released.values())
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    how = ("refused every connection (down)" if down else
           f"delayed every response by {SLOW_SECONDS:g} s (slow; read timeout 1.5 s)")
    number, target = ("13", f"p99 < {P99_TARGET_SECONDS:g} s") if down else ("13b", "context for 13")
    return Figure(number, f"release latency of {PODS} gated pods after the registry "
                          f"{'comes back' if down else 'is fast again'}",
                  f"p50 {p50:.2f} / p99 {p99:.2f} / max {latencies[-1]:.2f} s", target,
                  (p99 < P99_TARGET_SECONDS and placed == len(names) and not api.rejections)
                  if down else None, [(
                      f"{PODS} pods over {IMAGES} images admitted gated while a proxy {how} "
                      f"(deadline {DEADLINE:g} s); after 3 s of the controller's retries "
                      f"(0.25 s doubling to 1 s) the registry was back and each pod was timed "
                      f"until the stand-in held it released (polled every 5 ms); "
                      f"{placed}/{len(names)} placed with kubernetes.io/arch; "
                      f"{len(api.rejections)} updates rejected by the stand-in's "
                      f"ValidatePodUpdate")])


def _throughput(gated, plain, api, proxy, warm: bytes, busy_images) -> Figure:
    for server in (gated, plain):
        if mutated_archs(server.post("/mutate", warm)) != {"amd64", "arm64", "arm"}:
            raise RuntimeError(f"{server.name}: the warm pod was not mutated")
        run_wrk(server.url("/mutate"), warm, seconds=2, connections=CONNECTIONS, close_every=200)
    # Keep the controller busy: 100 more gated pods retrying against the slow registry.
    proxy.delay = SLOW_SECONDS
    _admit_gated(gated, api, busy_images, "b")
    def side(server):
        def one_run() -> float:
            result = run_wrk(server.url("/mutate"), warm, seconds=SECONDS,
                             connections=CONNECTIONS, close_every=200)
            if result.errors:
                raise RuntimeError(f"{server.name}: {result.errors} wrk errors")
            return result.rate
        return one_run
    count = rounds()
    try:
        rates = interleaved({gated.name: side(gated), plain.name: side(plain)}, count)
        busy = _gated_now(gated)
        controller_mb = sum(rss_bytes(pid) for pid in gated.controller_pids()) / 1e6
    finally:
        proxy.delay = 0.0
    steady = ratios(rates[gated.name], rates[plain.name])
    ratio = steady.median
    return Figure("14", "warm-cache admission throughput, gate controller busy vs no controller",
                  f"{steady.describe()} ({median(rates[gated.name]):.0f} vs "
                  f"{median(rates[plain.name]):.0f} req/s)", f">= {RATIO_TARGET}",
                  ratio >= RATIO_TARGET, [(
                      f"the same archway build twice: with the stand-in API, gate mode, its "
                      f"controller process retrying {busy:.0f} gated pods against a registry "
                      f"delayed {SLOW_SECONDS:g} s; and with kubernetes.enabled off (no "
                      f"controller); wrk {CONNECTIONS} connections, {count} interleaved rounds of "
                      f"{SECONDS} s (each first in turn); figure = median of the per-round "
                      f"ratios; the controller process's RSS {controller_mb:.0f} MB")],
                  rounds=steady)
