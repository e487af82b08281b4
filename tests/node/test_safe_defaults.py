"""Safe defaults on the real node (issue 38, finding 5), with archway installed by its chart:

- a pod whose image names a Service's ClusterIP, the `kubernetes` Service, the API server's own
  address, loopback or the node's kubelet port is told archway's policy refused it (one text
  per rule, whatever listens there; a registry merely unreachable, a refused connection or a
  TLS error, reads "registry unreachable"), and archway opens no connection there: a listener
  behind the Service records none, the API server and the kubelet log no TLS handshake from
  archway, and archway's log says its host policy refused each (before any socket);
- the webhook's ServiceAccount can no longer read Secrets in other namespaces (the authorizer's
  own SubjectAccessReview), and the chart's NetworkPolicy is in place by default.
"""
import re
import socket
import threading
import time

from lab.cluster.realnode import node_address
from lab.kube import pod_path

WARNING = re.compile(r'299 - "((?:[^"\\]|\\.)*)"')
CONTROL = b"CONTROL"


class RecordingListener:
    """Accepts on this machine's address and records every peer but the test's own control
    connections (they say CONTROL first: kube-proxy's NAT may deliver one late, and it must not
    be taken for archway's); answers nothing."""

    def __init__(self, host: str):
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.peers: list[str] = []
        self.controls = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._record, args=(conn, peer[0]), daemon=True).start()

    def _record(self, conn: socket.socket, peer: str) -> None:
        conn.settimeout(5)
        try:
            first = conn.recv(len(CONTROL))
        except OSError:
            first = b""
        conn.close()
        if first == CONTROL:
            self.controls += 1
        else:
            self.peers.append(peer)

    def close(self) -> None:
        self.sock.close()


def trap_service(kube, namespace: str, listener: RecordingListener) -> str:
    """A ClusterIP Service without a selector whose one endpoint is the listener: kube-proxy on
    the node sends its address to the listener. Its ClusterIP."""
    kube.create(f"/api/v1/namespaces/{namespace}/services", {"metadata": {"name": "trap"}, "spec": {
        "ports": [{"port": 5000, "targetPort": listener.port, "protocol": "TCP"}]}})
    kube.create(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "trap-1", "labels": {"kubernetes.io/service-name": "trap"}},
        "addressType": "IPv4", "endpoints": [{"addresses": [node_address()]}],
        "ports": [{"port": listener.port, "protocol": "TCP"}]})
    return kube.get(f"/api/v1/namespaces/{namespace}/services/trap")["spec"]["clusterIP"]


def warnings_for(kube, namespace: str, image: str) -> list[str]:
    """The warnings of a dry-run creation of a pod running `image`, with the image's name
    replaced by IMAGE, each cut where archway's clipping (120 characters) could not have cut
    it for any of the test's images."""
    kube.request("POST", pod_path(namespace), {
        "metadata": {"name": "probe"},
        "spec": {"containers": [{"name": "c", "image": image}]}}, params={"dryRun": "All"})
    return [w.replace(image, "IMAGE")[:70] for w in WARNING.findall(kube.last_warnings)]


def log_length(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def handshakes_since(path: str, offset: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    return [line for line in text.splitlines() if "TLS handshake error" in line]


def webhook_logs(install) -> str:
    kube = install.plane.kube
    text = ""
    for pod in kube.items(pod_path(install.namespace),
                          labelSelector="app.kubernetes.io/component=webhook"):
        path = f"{kube.server}{pod_path(install.namespace, pod['metadata']['name'])}/log"
        text += kube.session.get(path, params={"container": "webhook"}, timeout=30).text
    return text


def test_a_pods_image_cannot_make_archway_reach_the_clusters_own_places(in_cluster):
    plane = in_cluster.plane
    kube = plane.kube
    namespace = plane.new_namespace(f"safe-{int(time.time() * 1000) % 10**8}")
    listener = RecordingListener(node_address())
    try:
        cluster_ip = trap_service(kube, namespace, listener)
        # Control: the trap works; whatever connects to the ClusterIP reaches the listener.
        kube.wait_for(lambda: _reaches(cluster_ip) and listener.controls, timeout=30,
                      what="kube-proxy sending the trap Service to the listener")
        api_service = kube.get("/api/v1/namespaces/default/services/kubernetes")["spec"]["clusterIP"]
        endpoints = kube.get("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/kubernetes")
        api_address = endpoints["endpoints"][0]["addresses"][0]
        api_port = endpoints["ports"][0]["port"]
        pod_ip = kube.items(pod_path(in_cluster.namespace), labelSelector=(
            "app.kubernetes.io/component=webhook"))[0]["status"]["podIP"]
        images = {
            "service": f"{cluster_ip}:5000/trap/app:1",
            "kubernetes service": f"{api_service}:443/x/app:1",
            "api server": f"{api_address}:{api_port}/x/app:1",
            "loopback": "127.0.0.1:8443/x/app:1",            # archway's own port in its pod
            "loopback, spelled": "2130706433:8443/x/app:1",
            "kubelet": f"{node_address()}:10250/x/app:1",
            "kubelet read-only": f"{node_address()}:10255/x/app:1",
            # Controls, real network failures on a pod's address (outside every refused range):
            "refused (control)": f"{pod_ip}:1/x/app:1",       # nothing listens: RST
            "tls error (control)": f"{pod_ip}:8443/x/app:1",  # a certificate nobody trusts
        }
        apiserver_log = plane.processes["kube-apiserver"].log
        kubelet_log = plane.path("logs", "kubelet.log")
        marks = (log_length(apiserver_log), log_length(kubelet_log))
        texts = {kind: warnings_for(kube, namespace, image) for kind, image in images.items()}
        assert all(texts.values()), texts
        # A host refused before any connection says so (issue 47): the words follow from the
        # name and the config alone, whatever listens there (the trap's listener, the API
        # server behind its Service), so they tell no port's state. Real network failures
        # share one text.
        for kind in images:
            expected = "(registry unreachable)" if "control" in kind else "(refused by policy: "
            assert any(expected in w for w in texts[kind]), (kind, texts[kind])
        assert texts["service"] == texts["kubernetes service"], texts
        assert texts["loopback"] == texts["loopback, spelled"], texts
        assert texts["refused (control)"] == texts["tls error (control)"], texts
        assert listener.peers == [], "archway connected to the Service's address"
        assert handshakes_since(apiserver_log, marks[0]) == []
        assert handshakes_since(kubelet_log, marks[1]) == []
        logged = webhook_logs(in_cluster)
        for kind, image in images.items():
            if "control" not in kind:
                host = image.split("/", 1)[0]
                assert re.search(re.escape(host) + r" resolves to [^ ]+, [^:]*: archway contacts it "
                                 r"only when registry.allow_hosts lists it", logged), (kind, host)
    finally:
        listener.close()
        kube.delete(f"/api/v1/namespaces/{namespace}")


def _reaches(address: str) -> bool:
    try:
        with socket.create_connection((address, 5000), timeout=2) as conn:
            conn.sendall(CONTROL)
        return True
    except OSError:
        return False


def test_the_webhooks_service_account_reads_no_secret_of_another_namespace(in_cluster):
    """SubjectAccessReview by the authorizer itself, as `kubectl auth can-i --as` asks it."""
    kube = in_cluster.plane.kube
    account = in_cluster.service_account("webhook")
    user = f"system:serviceaccount:{in_cluster.namespace}:{account}"

    def allowed(verb: str, resource: str, namespace: str, group: str = "", name: str = "") -> bool:
        attrs = {"verb": verb, "resource": resource, "group": group, "namespace": namespace,
                 **({"name": name} if name else {})}
        review = kube.create("/apis/authorization.k8s.io/v1/subjectaccessreviews", {
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": ["system:serviceaccounts",
                                              f"system:serviceaccounts:{in_cluster.namespace}"],
                     "resourceAttributes": attrs}})
        return bool(review["status"].get("allowed"))

    for namespace in ("default", "kube-system", "team-a"):
        assert not allowed("get", "secrets", namespace), namespace
        assert not allowed("get", "secrets", namespace, name="any-token"), namespace
    # What it still needs, as the chart grants it by default.
    assert allowed("update", "pods", "team-a")               # gate mode releases gated pods
    assert allowed("list", "servicecidrs", "", group="networking.k8s.io")
    policies = kube.items(f"/apis/networking.k8s.io/v1/namespaces/{in_cluster.namespace}"
                          "/networkpolicies")
    assert policies, "the chart's NetworkPolicy is on by default"
