"""archway: architecture-aware pod placement for Kubernetes.

One import namespace over eight folders (pyproject's packages and package-dir): this package,
archway/, is the core; the rooms are `archway.registry` (registry/: which CPU architectures an
image supports), `archway.webhook` (webhook/: the admission webhook), `archway.gate` (gate/: gated
pods, their controller and its closed loop), `archway.tools` (tools/: explain and report),
`archway.extender` (extender/: the scheduler extender), `archway.certs` (certs/: TLS) and
`archway.server` (archway/server/: the gunicorn adapter: worker, lingering close, listeners,
master and options, the supervisor of the master's child processes).

The core has two floors:
- the ground every room stands on: vocabulary (architecture names and sets, the names archway
  writes on objects), config, errors, logsafe (what a log line or message may show) and logs
  (their format), hostport, kubeclient and kubeapi (the Kubernetes API), listwatch,
  watchcache and lease, podview, nodes, workloads and cluster (reads of the cluster), metrics,
  background, deadline and requestbody (a request's deadline, its body read within bounds);
- the top, which puts the rooms together into programs: cli (the `archway` command), serve
  (`archway serve`: config, TLS, preflight, then the server room), app (the Flask app of one
  worker), addresses, completion.
Rooms import the ground floor and the rooms below them: registry/ and certs/ nothing else,
webhook/ and extender/ registry/ (never each other), gate/ and tools/ the webhook's decision,
server/ certs/ (it serves TLS) and never a product. Nothing but the top imports gate/, tools/ or
server/, no room imports the top, nothing imports in a circle (tests/test_rooms.py). CONTRIBUTING.md has the map of where each kind of change goes.
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("archway")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
