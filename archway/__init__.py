"""archway: architecture-aware pod placement for Kubernetes.

The shared core lives here (configuration, errors, command line, serving, metrics); the
products are the subpackages `archway.webhook`, `archway.extender`, `archway.registry` and
`archway.certs`, kept in the top-level folders of the same names.
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("archway")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
