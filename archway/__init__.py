"""archway: architecture-aware pod placement for Kubernetes.

One import namespace over five folders (pyproject's package-dir): this package, archway/, is the
core; the rooms are `archway.registry` (registry/: which CPU architectures an image supports),
`archway.webhook` (webhook/: the admission webhook, and for now the gate and the operator tools),
`archway.extender` (extender/: the scheduler extender) and `archway.certs` (certs/: TLS).

The core has two floors:
- the ground every room stands on: config, errors, logsafe (what a log line or message may
  show), hostport, kubeclient and kubeapi (the Kubernetes API), listwatch and watchcache,
  podview, metrics, background;
- the top, which puts the rooms together into programs: cli (the `archway` command), serve
  (`archway serve` under gunicorn), app (the Flask app of one worker), worker (the gunicorn
  worker), addresses, logs, completion.
Rooms import the ground floor and registry/ (webhook/ and extender/ still take a few names from
each other, until the shared vocabulary is in the ground floor), never the top; nothing imports
in a circle (tests/test_rooms.py). CONTRIBUTING.md has the map of where each kind of change goes.
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("archway")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
