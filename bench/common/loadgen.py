"""wrk (Debian's) as the load generator: keep-alive connections POSTing one fixed body."""
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass

from lab.procs import require_binary

LUA_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "post.lua")


@dataclass(frozen=True)
class WrkResult:
    requests: int
    seconds: float
    errors: int               # non-2xx answers plus socket errors and timeouts
    p50_ms: float             # client side (wrk), queueing included
    p99_ms: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def run_wrk(url: str, body: bytes, *, seconds: float, connections: int, threads: int = 1,
            timeout_seconds: int = 5, close_every: int = 0) -> WrkResult:
    """POST `body` to `url` for `seconds` over `connections` keep-alive connections;
    `close_every` > 0 closes one connection every that many requests (see post.lua)."""
    wrk = require_binary("wrk")
    with tempfile.NamedTemporaryFile(prefix="bench-body-", suffix=".json") as f:
        f.write(body)
        f.flush()
        out = subprocess.run(
            [wrk, "-t", str(threads), "-c", str(connections), "-d", f"{seconds:g}s",
             "--timeout", f"{timeout_seconds}s", "-s", LUA_SCRIPT, url],
            env=dict(os.environ, BENCH_BODY=f.name, BENCH_CLOSE_EVERY=str(close_every)),
            capture_output=True, text=True,
            timeout=seconds + 60)
    line = next((text for text in out.stdout.splitlines() if text.startswith("BENCH-JSON ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}")
    data = json.loads(line[len("BENCH-JSON "):])
    errors = sum(data[k] for k in ("status_errors", "connect_errors", "read_errors",
                                   "write_errors", "timeouts"))
    return WrkResult(data["requests"], data["duration_us"] / 1e6, errors,
                     data["p50_us"] / 1000, data["p99_us"] / 1000)
