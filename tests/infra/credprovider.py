"""A real kubelet credential provider plugin for tests: an executable speaking the exact JSON.

    plugin = ProviderPlugin(tmp_path)                     # writes bin/<name> and a config file
    config = plugin.config(provider(...), provider(...))  # a CredentialProviderConfig, on disk
    plugin.calls()                                        # every request it received, in order

The plugin checks the CredentialProviderRequest strictly (exactly kind, apiVersion and image,
with the apiVersion it is configured for) and answers from its environment, which the config's
`env` sets as the kubelet would: MODE (ok, hang, garbage, fail, flood), KEY_TYPE, DURATION
("omit" leaves cacheDuration out), AUTH_KEY ("{registry}" becomes the image's registry),
USERNAME, PASSWORD. Each run appends {image, argv, pid, child} to the calls file first.
"""
import json
import os
import stat
import sys

import yaml

PLUGIN_SOURCE = r'''#!{python}
import json, os, subprocess, sys, time

request = json.loads(sys.stdin.read())
expected = {{"kind": "CredentialProviderRequest", "apiVersion": os.environ["API_VERSION"]}}
if set(request) != {{"kind", "apiVersion", "image"}} or any(request[k] != v for k, v in expected.items()):
    print(f"unexpected request: {{request}}", file=sys.stderr)
    sys.exit(3)
mode = os.environ.get("MODE", "ok")
child = subprocess.Popen(["sleep", "60"]).pid if mode == "hang" else None
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps({{"image": request["image"], "argv": sys.argv[1:], "pid": os.getpid(),
                        "child": child}}) + "\n")
if mode == "hang":
    time.sleep(60)
elif mode == "garbage":
    print("this is {{not json")
elif mode == "fail":
    print("AccessDeniedException: no identity-based policy allows ecr:GetAuthorizationToken",
          file=sys.stderr)
    sys.exit(1)
elif mode == "flood":
    chunk = b"x" * 65536
    for _ in range(160):   # 10 MiB
        sys.stdout.buffer.write(chunk)
else:
    registry = request["image"].split("/")[0]
    answer = {{"apiVersion": os.environ["API_VERSION"], "kind": "CredentialProviderResponse",
              "cacheKeyType": os.environ.get("KEY_TYPE", "Registry"),
              "auth": {{os.environ.get("AUTH_KEY", "{{registry}}").replace("{{registry}}", registry): {{
                  "username": os.environ.get("USERNAME", "alice"),
                  "password": os.environ.get("PASSWORD", "")}}}}}}
    if os.environ.get("DURATION", "omit") != "omit":
        answer["cacheDuration"] = os.environ["DURATION"]
    print(json.dumps(answer))
'''

API_VERSION = "credentialprovider.kubelet.k8s.io/v1"


def provider(name="test-provider", match=("*", "*.*", "*.*.*"), *, mode="ok", key_type="Registry",
             duration="omit", default_duration="10m", username="alice", password="",
             auth_key="{registry}", args=(), api_version=API_VERSION) -> dict:
    """One `providers[]` entry of a CredentialProviderConfig for the test plugin."""
    env = {"MODE": mode, "KEY_TYPE": key_type, "DURATION": duration, "USERNAME": username,
           "PASSWORD": password, "AUTH_KEY": auth_key, "API_VERSION": api_version}
    entry = {"name": name, "matchImages": list(match), "defaultCacheDuration": default_duration,
             "apiVersion": api_version, "env": [{"name": k, "value": v} for k, v in env.items()]}
    if args:
        entry["args"] = list(args)
    return entry


class ProviderPlugin:
    def __init__(self, directory, names=("test-provider",)):
        self.directory = str(directory)
        self.bin_dir = os.path.join(self.directory, "bin")
        self.calls_path = os.path.join(self.directory, "calls.jsonl")
        self.config_path = os.path.join(self.directory, "credential-providers.yaml")
        os.makedirs(self.bin_dir, exist_ok=True)
        for name in names:
            self.install(name)

    def install(self, name: str) -> str:
        path = os.path.join(self.bin_dir, name)
        with open(path, "w") as f:
            f.write(PLUGIN_SOURCE.format(python=sys.executable))
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return path

    def config(self, *providers: dict, path: str | None = None) -> str:
        """Write a CredentialProviderConfig; every provider records its calls in calls_path."""
        for entry in providers:
            entry["env"] = [e for e in entry["env"] if e["name"] != "CALLS"] + [
                {"name": "CALLS", "value": self.calls_path}]
        document = {"apiVersion": "kubelet.config.k8s.io/v1", "kind": "CredentialProviderConfig",
                    "providers": list(providers)}
        path = path or self.config_path
        with open(path + ".tmp", "w") as f:
            yaml.safe_dump(document, f)
        os.replace(path + ".tmp", path)   # a new inode, as a Kubernetes volume update makes
        return path

    def calls(self) -> list[dict]:
        if not os.path.exists(self.calls_path):
            return []
        with open(self.calls_path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def images(self) -> list[str]:
        return [c["image"] for c in self.calls()]
