"""`archway explain pod/NAME`: a live pod read through the kubeconfig, with what the webhook
would read (its pull secrets, the cluster's image records, the Nodes, its workload's learned
exclusions) and what archway wrote about it (its annotations, archway's Events)."""
import time
from collections.abc import Iterable

from archway.cluster.workloads import Workload
from archway.errors import ArchwayError
from archway.placement.policy import Policy
from archway.podview import PodView

from .explanation import Explanation, explain_workload, pod_view


def explain_live_pod(name: str, namespace: str, config, policy: Policy,
                     timeout: float) -> Explanation:
    from archway.cluster.nodes import node_facts
    from archway.cluster.pullsecrets import PullSecrets
    from archway.cluster.reads import ClusterReader
    from archway.objects.imagerecords import read_records
    from archway.registry.resolver import Resolver

    from .explainpolicy import KnownPolicies, read_from_cluster

    reader = ClusterReader.from_config(config)
    workload = Workload("Pod", namespace, name, reader.pod(namespace, name))
    pod = pod_view(workload)
    known = KnownPolicies()
    read_from_cluster(known, config)
    credentials = PullSecrets(reader.api_client).credentials_for(pod, time.monotonic() + timeout)
    resolver = Resolver(config.registry, sif=config.sif)
    records = read_records(config, reader.api_client, resolver)   # what archway knows first
    try:
        results = resolver.resolve_many(pod.images, timeout=timeout, keyring=credentials.keyring,
                                        scope=namespace)
    finally:
        if records is not None:
            records.stop()
    nodes = [f for f in map(node_facts, _nodes(reader)) if f is not None]
    annotations = {k: v for k, v in pod.annotations.items() if k.startswith("archway.dev/")}
    top = live_workload(reader, pod)
    learned = top.learned if top and config.remediation.learn_failed_architectures else None
    return explain_workload(workload, results, policy, nodes=nodes or None,
                            annotations=annotations,
                            events=archway_events(reader, pod, top.object_name if top else None),
                            learned=learned, known=known,
                            namespace_object=reader.namespace(namespace),
                            archway_scheduler=config.placement.archway_scheduler)


def live_workload(reader, pod: PodView):
    """The pod's top workload (workloadcache.WorkloadFacts) read through the API, or None (no
    controller, a kind archway does not know, or not readable)."""
    from archway.cluster.workloadcache import pod_owner, top_workload, workload_facts

    def lookup(kind: str, namespace: str, name: str):
        try:
            return workload_facts(kind)(reader.workload(kind, namespace, name))
        except ArchwayError:
            return None
    return top_workload(pod.namespace, pod_owner(pod), lookup)


def archway_events(reader, pod: PodView, workload: str | None = None) -> list[dict]:
    """archway's Events about the pod, its controller or its workload (admission Events go to
    the controller when the pod had no name yet; exec format errors also to the workload)."""
    from archway.cluster.events import REPORTING_CONTROLLER
    names = {pod.name} | {o.name for o in pod.owner_references if o.controller}
    if workload:
        names.add(workload)
    found = []
    for event in reader.events(pod.namespace):
        regarding = event.get("regarding") or {}
        if event.get("reportingController") == REPORTING_CONTROLLER and regarding.get("name") in names:
            found.append({"type": event.get("type", ""), "reason": event.get("reason", ""),
                          "object": f"{regarding.get('kind', '')}/{regarding.get('name', '')}",
                          "message": event.get("note", ""), "time": event.get("eventTime")})
    return found


def _nodes(reader) -> Iterable[dict]:
    try:
        return reader.nodes()
    except ArchwayError:
        return []   # no RBAC for nodes: the cluster's nodes are simply not consulted
