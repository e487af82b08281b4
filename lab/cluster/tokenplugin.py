"""A kubelet credential provider plugin in service account token mode (KEP-4412) that trusts
nothing it is told: before it answers, it asks the real API server (a TokenReview, with
credentials of its own from the kubeconfig in its environment) whether the token it was given
is genuine, for its audience, and of a ServiceAccount it has credentials for.

    path = install(bin_dir)                       # bin_dir/lab-token-provider
    entry = provider_entry(match=[registry.host], audience="registry.lab",
                           kubeconfig=reviewer_kubeconfig, calls=calls_path,
                           accounts={"team-a/puller": ("alice", "pw")},
                           required=["lab.archway.dev/robot"])
    calls(calls_path)   # [{image, user, audiences, annotations, answered}, ...]: never a token

ACCOUNTS maps "namespace/name" to the registry credential that ServiceAccount may pull with;
any other identity, an unauthenticated token or one for another audience is refused (exit 1,
saying why on stderr). TOKEN_FILE, when set, receives the token itself: a test's way to look
for it where it must not be.
"""
import json
import os
import stat
import sys

NAME = "lab-token-provider"
API_VERSION = "credentialprovider.kubelet.k8s.io/v1"

SOURCE = r'''#!{python}
import json, os, ssl, sys, urllib.request
import yaml

request = json.loads(sys.stdin.read())
token = request.get("serviceAccountToken") or ""
record = {{"image": request.get("image"), "annotations": request.get("serviceAccountAnnotations"),
          "user": None, "audiences": None, "answered": False}}

def done(code, why=""):
    with open(os.environ["CALLS"], "a") as f:
        f.write(json.dumps(record) + "\n")
    if why:
        print(why, file=sys.stderr)
    sys.exit(code)

if os.environ.get("TOKEN_FILE"):
    with open(os.environ["TOKEN_FILE"], "w") as f:
        f.write(token)
if os.environ.get("ECHO_TOKEN"):
    done(1, f"refusing token {{token}}")
if not token:
    done(2, "no serviceAccountToken in the request")
with open(os.environ["KUBECONFIG"]) as f:
    config = yaml.safe_load(f)
cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
audience = os.environ["AUDIENCE"]
review = {{"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
          "spec": {{"token": token, "audiences": [audience]}}}}
http = urllib.request.Request(cluster["server"] + "/apis/authentication.k8s.io/v1/tokenreviews",
                              data=json.dumps(review).encode(), method="POST",
                              headers={{"Authorization": "Bearer " + user["token"],
                                       "Content-Type": "application/json"}})
context = ssl.create_default_context(cafile=cluster["certificate-authority"])
with urllib.request.urlopen(http, context=context, timeout=10) as answer:
    status = json.load(answer).get("status") or {{}}
record["user"] = (status.get("user") or {{}}).get("username")
record["audiences"] = status.get("audiences")
if not status.get("authenticated") or audience not in (status.get("audiences") or []):
    done(1, f"TokenReview: not authenticated for audience {{audience}}: {{status.get('error')}}")
accounts = json.loads(os.environ["ACCOUNTS"])
prefix = "system:serviceaccount:"
who = record["user"][len(prefix):].replace(":", "/", 1) if record["user"].startswith(prefix) else ""
if who not in accounts:
    done(1, f"{{record['user']}} has no registry credential here")
username, password = accounts[who]
registry = request["image"].split("/")[0]
record["answered"] = True
answer = {{"apiVersion": "{api_version}", "kind": "CredentialProviderResponse",
          "cacheKeyType": "Registry", "auth": {{registry: {{"username": username,
                                                          "password": password}}}}}}
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps(record) + "\n")
print(json.dumps(answer))
'''


def install(bin_dir: str, name: str = NAME) -> str:
    """The plugin as an executable in `bin_dir`, run by this Python (which has PyYAML)."""
    os.makedirs(bin_dir, exist_ok=True)
    path = os.path.join(bin_dir, name)
    with open(path, "w") as f:
        f.write(SOURCE.format(python=sys.executable, api_version=API_VERSION))
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def provider_entry(*, match, audience: str, kubeconfig: str, calls: str, accounts: dict,
                   cache_type: str = "ServiceAccount", required=(), optional=(),
                   require_service_account: bool = True, name: str = NAME,
                   extra_env: dict | None = None) -> dict:
    """A `providers[]` entry of a CredentialProviderConfig for the plugin."""
    env = {"KUBECONFIG": kubeconfig, "AUDIENCE": audience, "CALLS": calls,
           "ACCOUNTS": json.dumps({k: list(v) for k, v in accounts.items()}), **(extra_env or {})}
    return {"name": name, "matchImages": list(match), "defaultCacheDuration": "10m",
            "apiVersion": API_VERSION,
            "tokenAttributes": {"serviceAccountTokenAudience": audience, "cacheType": cache_type,
                                "requireServiceAccount": require_service_account,
                                **({"requiredServiceAccountAnnotationKeys": list(required)}
                                   if required else {}),
                                **({"optionalServiceAccountAnnotationKeys": list(optional)}
                                   if optional else {})},
            "env": [{"name": k, "value": v} for k, v in env.items()]}


def calls(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
