"""The Go webhook of bench figure 1d (lab/cluster/go/patch-webhook): on loopback with a throw-away
certificate, it answers a real AdmissionReview with the review's uid and exactly the patch it was
given, and a body it cannot read with a 400. Slow: its first build compiles Go's HTTPS stack
(about 30 s cold; cached in ~/.cache/archway/bin after)."""
import base64
import json
import os

import pytest
import requests

from lab.cluster.nodeimages import go_binary
from lab.procs import REPO, Server, free_port
from lab.tls import CertificateAuthority

pytestmark = pytest.mark.slow
PATCH = b'[{"op":"add","path":"/spec/affinity","value":{"nodeAffinity":{}}}]'


@pytest.fixture
def webhook(tmp_path):
    """(base URL, CA file) of the Go webhook serving PATCH."""
    ca = CertificateAuthority(tmp_path / "ca")
    pair = ca.issue("patch-webhook", ["127.0.0.1"])
    (tmp_path / "patch.json").write_bytes(PATCH)
    port = free_port()
    server = Server([go_binary("patch-webhook"), f"127.0.0.1:{port}", pair.chain_path,
                     pair.key_path, str(tmp_path / "patch.json")], port=port,
                    log_path=str(tmp_path / "patch-webhook.log"))
    try:
        yield f"https://127.0.0.1:{port}", ca.cert_path
    finally:
        server.stop()


def test_the_go_webhook_answers_the_reviews_uid_with_exactly_its_patch(webhook):
    url, ca = webhook
    with open(os.path.join(REPO, "tests", "fixtures", "admission", "v1-pod-multiarch.json")) as f:
        review = f.read().replace("REGISTRY", "registry.example:5000")
    with requests.Session() as http:
        http.trust_env, http.verify = False, ca
        answer = http.post(url + "/mutate", data=review, timeout=10,
                           headers={"Content-Type": "application/json"})
        assert answer.status_code == 200
        got = answer.json()
        assert got["apiVersion"] == "admission.k8s.io/v1" and got["kind"] == "AdmissionReview"
        response = got["response"]
        assert response["uid"] == json.loads(review)["request"]["uid"]
        assert response["allowed"] is True and response["patchType"] == "JSONPatch"
        assert base64.b64decode(response["patch"]) == PATCH
        assert http.get(url + "/healthz", timeout=10).json() == {"status": "ok"}

        # valid JSON but for its size: the apiserver's 3 MiB limit on a request to a webhook
        huge = json.dumps(dict(json.loads(review), padding="x" * (3 << 20))).encode()
        for bad in (b"{", b'{"apiVersion": "admission.k8s.io/v1"}', huge):
            refused = http.post(url + "/mutate", data=bad, timeout=10)
            assert refused.status_code == 400, bad[:40]
            assert "error" in refused.json()
