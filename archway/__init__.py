"""archway: architecture-aware pod placement for Kubernetes.

One import namespace over the folders pyproject's packages and package-dir name: this package,
archway/, is the ground floor every room stands on (vocabulary: architecture names and sets,
the names archway writes on objects; config; errors; logsafe and logs; hostport; kubeclient and
kubeapi; listwatch, watchcache and lease; labelselector; podview; metrics; background; deadline;
statusfile), with archway/server/ (serving HTTP). Above it the shared rooms: `archway.registry`
(registry/: which CPU architectures an image supports), `archway.certs` (certs/: TLS),
`archway.placement` (placement/: the placement model, pure), `archway.objects` (objects/:
archway's own Kubernetes objects) and `archway.cluster` (cluster/: the cluster as archway reads
it); then the products, `archway.webhook`, `archway.extender`, `archway.gate` and
`archway.tools`, which never import one another; and the top, `archway.main` (main/: the
command line, `archway serve`, a serving worker put together). tests/test_rooms.py holds the
floors; CONTRIBUTING.md has the map of where each kind of change goes.
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("archway")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
