"""`archway admission-review`: an AdmissionReview of a Pod's creation, as the kube-apiserver sends
one to POST /mutate, printed for curl (`archway serve` prints the line: it works wherever archway
is installed, with no file of the checkout).

The default image names 127.0.0.1:9, a loopback address archway never contacts for a pod's image
(registry.hostpolicy; and nothing listens there): the webhook answers at once, admitting the pod
unchanged with a warning (fail-open), without a registry or the network.
"""
import json
import uuid

UNREACHABLE_IMAGE = "127.0.0.1:9/team/app:1.0"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "admission-review", help="print an AdmissionReview of a Pod to post to /mutate",
        description="Print an AdmissionReview (admission.k8s.io/v1) of a Pod's creation, as the "
                    "kube-apiserver sends one to the webhook: pipe it to curl --data @- to try "
                    "`archway serve`. The default image is on a host where nothing listens, so "
                    "the answer needs no registry.")
    parser.add_argument("--image", default=UNREACHABLE_IMAGE,
                        help="the container's image (default: %(default)s)")
    parser.add_argument("--namespace", default="default",
                        help="the Pod's namespace (default: %(default)s)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    print(json.dumps(admission_review(args.image, args.namespace), indent=2))
    return 0


def admission_review(image: str = UNREACHABLE_IMAGE, namespace: str = "default") -> dict:
    """The review of `kubectl run` creating a Pod named `try` with one container of `image`."""
    pod_kind = {"group": "", "version": "v1", "kind": "Pod"}
    pods = {"group": "", "version": "v1", "resource": "pods"}
    pod = {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": "try", "namespace": namespace, "creationTimestamp": None},
        "spec": {"containers": [{"name": "app", "image": image, "resources": {},
                                 "imagePullPolicy": "IfNotPresent"}],
                 "restartPolicy": "Always", "dnsPolicy": "ClusterFirst",
                 "serviceAccountName": "default", "schedulerName": "default-scheduler"},
        "status": {},
    }
    return {
        "kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1",
        "request": {
            "uid": str(uuid.uuid4()), "kind": pod_kind, "resource": pods,
            "requestKind": pod_kind, "requestResource": pods, "name": "try",
            "namespace": namespace, "operation": "CREATE",
            "userInfo": {"username": "kubernetes-admin", "groups": ["system:authenticated"]},
            "object": pod, "oldObject": None, "dryRun": False,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1",
                        "fieldManager": "kubectl-run"},
        },
    }
