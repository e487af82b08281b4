"""The Kubernetes API client of this process: found by one precedence, built once.

Where the API is found (kubernetes.enabled `auto`, docs/configuration.md):

1. `kubernetes.kubeconfig` (`archway certs bootstrap --kubeconfig`) when set: it must be
   usable (ConfigError saying why otherwise);
2. the in-cluster service account (a pod: KUBERNETES_SERVICE_HOST and the mounted token);
3. the first file `$KUBECONFIG` names, else ~/.kube/config, when it exists;
4. none: the commands that need the API say so (`no_api_configured`), the servers run without.

`kubernetes.enabled: off` means none, without looking. Every part of a process (pull secrets,
the Namespace and Node caches, the pod watch, the gate's Lease and Events, the commands) shares
the one ApiClient, and so its connection pool: a forked worker builds its own on first use.
"""
import os
import threading
from collections.abc import Callable

from archway.errors import ArchwayError, ConfigError
from archway.vocabulary import USER_AGENT

IN_CLUSTER_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# One pool for every reader of a worker: its request threads (server.threads) reading pull
# secrets, two watches held open, the Lease and the Events. More connections than this are
# still made when needed, but closed after use (with a urllib3 warning line each).
POOL_SIZE = 32
IN_CLUSTER = "in-cluster service account"   # where build_api_client found the API, in a pod

_built: dict[tuple, tuple[object | None, str]] = {}
_lock = threading.Lock()


def build_api_client(settings) -> tuple[object | None, str]:
    """(ApiClient or None, where it came from, or why there is none) for `settings`
    (config.KubernetesSettings), built on the first call of this process and the same after.
    Without a client the second value is "disabled", "none" (nothing configured) or a sentence
    saying what is wrong."""
    if settings.enabled == "off":
        return None, "disabled"
    if settings.enabled != "auto":
        raise ConfigError(f"kubernetes.enabled must be auto or off, got {settings.enabled!r}")
    # Everything the choice depends on: a forked worker, or a test changing $KUBECONFIG or
    # $HOME, gets a client of its own.
    context = getattr(settings, "context", None)   # settings of any shape that names a kubeconfig
    key = (os.getpid(), settings.kubeconfig, context, os.environ.get("KUBECONFIG"),
           os.path.expanduser("~/.kube/config"), os.environ.get("KUBERNETES_SERVICE_HOST"),
           os.environ.get("KUBERNETES_SERVICE_PORT"))
    with _lock:
        if key not in _built:
            _built[key] = _build(settings.kubeconfig, context)
        return _built[key]


def api_client_factory(settings) -> Callable[[], object | None]:
    """build_api_client's client, got when a reader first needs it: a list + watch takes it in
    its own thread, so it is the client of the process that runs the thread (a forked worker's
    own), and a kubeconfig that breaks fails that reader only."""
    return lambda: build_api_client(settings)[0]


def no_api_configured(source: str, option: str = "kubernetes.kubeconfig in the config file"
                      ) -> ArchwayError:
    """The error of a command that needs the API, from build_api_client's second value;
    `option`: where the command takes a kubeconfig."""
    if source == "none":
        return ArchwayError(f"no Kubernetes API configured: set KUBECONFIG, or {option}")
    if source == "disabled":
        return ArchwayError("no Kubernetes API: kubernetes.enabled is off in the config file")
    return ArchwayError(f"no Kubernetes API: {source}")


def required_api_client(settings, option: str = "kubernetes.kubeconfig in the config file"):
    """build_api_client's client for a command that cannot work without the API; its error
    (no_api_configured) otherwise."""
    api_client, source = build_api_client(settings)
    if api_client is None:
        raise no_api_configured(source, option)
    return api_client


def api_kind(source: str, *, connected: bool) -> str:
    """What an unauthenticated reader (/readyz) may learn of build_api_client's second value:
    the kind of source, never a file's path nor why it is unusable (the start-up log says)."""
    if connected:
        return "in-cluster" if source == IN_CLUSTER else "kubeconfig"
    return source if source in ("none", "disabled") else "unusable (see the log)"


def in_cluster_namespace() -> str | None:
    """The namespace of the pod this process runs in (its service account's), else None."""
    try:
        with open(IN_CLUSTER_NAMESPACE_FILE, encoding="utf-8") as f:
            return f.read(256).strip() or None
    except OSError:
        return None


def _expand(paths: str) -> str:
    return os.pathsep.join(os.path.expanduser(p) for p in paths.split(os.pathsep))


def kubeconfig_files(settings) -> list[str] | None:
    """The kubeconfig files build_api_client reads for `settings`, in kubectl's merge order;
    None when it reads none (the in-cluster service account, or no API)."""
    if settings.enabled == "off":
        return None
    if settings.kubeconfig:
        return _expand(settings.kubeconfig).split(os.pathsep)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and in_cluster_namespace() is not None:
        return None
    named = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    default = os.path.expanduser(named or "~/.kube/config")
    return [default] if os.path.exists(default) else None


def current_namespace(settings) -> str:
    """The namespace a command means when none is named, as kubectl finds it: the context's
    (`settings.context`, else the kubeconfig's current-context) namespace, merged over the
    files as kubectl merges them (the first file to set a value wins); in a pod, its own;
    else "default". Read without the kubernetes client (plain YAML)."""
    files = kubeconfig_files(settings)
    if files is None:
        return (in_cluster_namespace() if os.environ.get("KUBERNETES_SERVICE_HOST") else None) \
            or "default"
    import yaml
    current, contexts = None, {}
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f.read(1 << 20))
        except (OSError, yaml.YAMLError):
            continue   # the client says what is wrong with it, when it reads it
        if not isinstance(data, dict):
            continue
        current = current or data.get("current-context")
        for entry in data.get("contexts") or ():
            if isinstance(entry, dict) and entry.get("name") not in contexts:
                contexts[entry.get("name")] = entry.get("context") or {}
    context = contexts.get(getattr(settings, "context", None) or current)
    namespace = context.get("namespace") if isinstance(context, dict) else None
    return namespace if isinstance(namespace, str) and namespace else "default"


def _build(kubeconfig: str | None, context: str | None = None) -> tuple[object | None, str]:
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config
    from kubernetes.config.config_exception import ConfigException
    if kubeconfig:
        return _from_kubeconfig(_expand(kubeconfig), required=True, context=context)
    configuration = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except ConfigException:
        pass
    else:
        return _api_client(configuration), IN_CLUSTER
    named = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    default = os.path.expanduser(named or "~/.kube/config")
    if os.path.exists(default):
        return _from_kubeconfig(default, required=False, context=context)
    if named:
        return None, f"KUBECONFIG names {default}, which does not exist"
    return None, "none"


def _from_kubeconfig(path: str, *, required: bool, context: str | None = None
                     ) -> tuple[object | None, str]:
    import yaml
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config
    from kubernetes.config.config_exception import ConfigException
    configuration = k8s.Configuration()
    try:
        # A path list (a:b) is merged by the client as kubectl merges $KUBECONFIG.
        k8s_config.load_kube_config(config_file=path, context=context,
                                    client_configuration=configuration)
    except (ConfigException, OSError, ValueError, TypeError, KeyError, AttributeError,
            yaml.YAMLError) as e:
        why = f"kubeconfig {path} is not usable: {' '.join(str(e).split())[:300]}"
        if required:
            raise ConfigError(why) from None
        return None, why
    return _api_client(configuration), f"kubeconfig {path}"


def _api_client(configuration):
    from kubernetes import client as k8s
    # No retries: a failed read already costs admission time, the caches retry with their own
    # back-off, and a failure is one line (urllib3 logs a warning per retry).
    configuration.retries = False
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize, POOL_SIZE)
    client = k8s.ApiClient(configuration)
    client.user_agent = USER_AGENT   # not the client library's OpenAPI-Generator/...
    return client
