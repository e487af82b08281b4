"""Figure 12: how many stalled clients `archway serve` holds while it keeps answering admissions.

A client that opens a connection and sends nothing, 3 bytes of a ClientHello, half a request
line or a head and part of a body, then stalls, used to hold one of the 16 handler threads for
as long as it liked: 10-12 such clients made real admissions fail, 16-24 stopped the webhook
(issue 16). For each count N of STALLED (an equal share of each kind of lab/servers/stalled.py,
all opened first), REAL admissions are then posted on fresh TLS connections (new accept, new
handshake: the path a stalled client blocks) with a per-request timeout; the figure is the
largest N at which every one of them was answered with a mutation.

The stalled clients must still be held while the admissions run for N to mean anything: the
server cuts them off after 5 s (handshake, header) or 10 s (body), so the notes give how many
were still open when the last admission was answered, and the time the admissions took.
"""
import ssl
import statistics
import time

import requests

from bench.common.lab import PLATFORMS, Lab, fixture_text, mutated_archs
from bench.common.report import Figure
from bench.common.section import Started, measured
from bench.common.servers import GunicornServer
from lab.servers.registry import RegistryServer
from lab.servers.stalled import KINDS, stalled, still_open

STALLED = (16, 100, 500, 1000, 2000, 4000)
REAL = 20
TIMEOUT_SECONDS = 5.0
TARGET = 500
SPEC = ("12", "stalled clients held while every real admission is answered", f">= {TARGET} stalled")


def run(lab: Lab) -> list[Figure]:
    return measured([SPEC], lambda started: _measure(lab, started))


def _measure(lab: Lab, started: Started) -> list[Figure]:
    number, name, target = SPEC
    registry = started(RegistryServer(lab.path("registry-slowclients"), ca=lab.ca))
    registry.push_index("archway/multi", "1.0", list(PLATFORMS))
    server = started(GunicornServer.archway(lab.path("slowclients"),
                                            lab.archway_config("slowclients"),
                                            tls_ca=lab.ca.cert_path))
    body = fixture_text("v1-pod-multiarch.json").replace("REGISTRY", registry.host).encode()
    _admit(server, body)   # warm: the image is cached
    rows = [_round(server, body, n) for n in STALLED]
    cuts = _cuts(server.metrics())
    held = [row for row in rows if row["answered"] == REAL]
    best = max((row["stalled"] for row in held), default=0)
    return [Figure(number, name, f"{best} (of {', '.join(map(str, STALLED))} tried)", target,
                   best >= TARGET, [
        (f"per N: {REAL} admissions on fresh TLS connections, {TIMEOUT_SECONDS:g} s timeout "
         f"each, after opening N stalled connections ({', '.join(KINDS)}, N/{len(KINDS)} each; "
         "2 workers x 8 threads)"),
        "; ".join(f"N={row['stalled']}: {row['answered']}/{REAL} answered, median "
                  f"{row['median_ms']:.0f} ms, {row['open']} of N still open after "
                  f"{row['seconds']:.1f} s" for row in rows),
        ("connections cut off by the server over the run (archway_client_connections_cut_total): "
         + (", ".join(f"{reason} {n:.0f}" for reason, n in sorted(cuts.items()))
            or "none (each round's clients hung up before their deadline)")),
        ("before this change (gunicorn's gthread worker, issue 16): 10-12 stalled connections "
         "made real admissions fail, 16-24 stopped the webhook"),
    ])]


def _round(server: GunicornServer, body: bytes, count: int) -> dict:
    tls = ssl.create_default_context(cafile=server.ca)
    address = ("127.0.0.1", server.port)
    kinds = list(KINDS)
    held = []
    try:
        for i in range(count):
            held.append(stalled(address, kinds[i % len(kinds)], tls, body))
        started = time.monotonic()
        answered, times = 0, []
        for _ in range(REAL):
            t = time.monotonic()
            try:
                answered += _admit(server, body)
                times.append((time.monotonic() - t) * 1000)
            except (requests.RequestException, RuntimeError):
                pass
        seconds = time.monotonic() - started
        still = sum(still_open(s) for s in held)
    finally:
        for s in held:
            s.close()
    return {"stalled": count, "answered": answered, "open": still, "seconds": seconds,
            "median_ms": statistics.median(times) if times else float("nan")}


def _admit(server: GunicornServer, body: bytes) -> bool:
    with requests.Session() as session:   # a fresh connection: accept and TLS handshake
        session.trust_env = False
        session.verify = server.ca
        r = session.post(server.url("/mutate"), data=body, timeout=TIMEOUT_SECONDS,
                         headers={"Content-Type": "application/json"})
    return r.status_code == 200 and bool(mutated_archs(r))


def _cuts(metrics_text: str) -> dict[str, float]:
    cuts: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("archway_client_connections_cut_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            cuts[reason] = float(line.rsplit(" ", 1)[1])
    return cuts
