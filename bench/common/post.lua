-- wrk script: POST the file named by $BENCH_BODY as JSON on every request, and print one
-- machine-readable summary line (BENCH-JSON ...) at the end for bench/common/loadgen.py.
-- $BENCH_CLOSE_EVERY=N (N > 0): every Nth request of a wrk thread asks the server to close the
-- connection ("Connection: close"); wrk reconnects, and the new connection goes to whichever
-- gunicorn worker accepts it, so no worker keeps all connections for a whole run.
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"

local close_every = tonumber(os.getenv("BENCH_CLOSE_EVERY") or "0") or 0
local keep, closing, sent

function init(args)
  keep = wrk.format()
  wrk.headers["Connection"] = "close"
  closing = wrk.format()
  wrk.headers["Connection"] = nil
  sent = 0
end

function request()
  sent = sent + 1
  if close_every > 0 and sent % close_every == 0 then
    return closing
  end
  return keep
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH-JSON {"requests":%d,"duration_us":%d,"bytes":%d,"status_errors":%d,' ..
    '"connect_errors":%d,"read_errors":%d,"write_errors":%d,"timeouts":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}\n',
    summary.requests, summary.duration, summary.bytes, e.status, e.connect, e.read, e.write,
    e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max))
end
