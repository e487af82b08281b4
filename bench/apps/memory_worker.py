"""`archway serve` plus one bench-only route, for figure 9 (RSS per worker with 10,000 images).

    python3 -m bench.apps.memory_worker --config FILE serve --bind 127.0.0.1:PORT

Everything is archway's own serving code (archway.main.cli -> archway.main.serve -> archway.main.worker); the
only difference is `POST /bench/fill`, added to the routes each worker builds through
archway.main.serve.serve's own `extend`. That route resolves many image names through the worker's own resolver
(`Resolver.resolve_many`: cache keys, digest aliases, TTLs, single-flight as for any pod) and its
registry client's parsing (`RegistryClient.resolve`, the client its access layer calls), replacing
only the network: the manifest of one real image is fetched from the registry once, and every
name is answered with a copy of it that carries the name as an annotation (so each image has its
own body and digest, as distinct images do).

    {"template": "host/repo:tag",  # a real multi-platform image on the registry
     "images": [image, ...],       # names to resolve from the replayed answer
     "per_pod": 30}                # resolved this many at a time, as admissions of such pods
                                   # would (one burst of 10,000 would measure its transients)
"""
import hashlib
import json
import sys
import time

from requests.structures import CaseInsensitiveDict

from archway.main import cli
from archway.registry import manifests, oci
from archway.registry.http import Response
from archway.registry.reference import parse_reference
from archway.server.routes import Reply, Route


def _add_fill_route(worker) -> None:
    resolver = worker.resolver
    worker.site.routes.add(Route("POST", "/bench/fill", lambda request: _fill(resolver, request),
                                 max_body=64 << 20))


class _ReplayedRegistry:
    """Stands in for HttpClient: answers every manifest GET with a variant of one real answer."""

    def __init__(self, answer: Response):
        self.answer = answer
        self.document = json.loads(answer.body)

    def get(self, url, *, headers=None, deadline=None, max_bytes, method="GET") -> Response:
        document = dict(self.document, annotations={"org.opencontainers.image.ref.name": url})
        body = json.dumps(document).encode()
        return Response(200, CaseInsensitiveDict({
            "Content-Type": self.answer.headers["Content-Type"],
            "Docker-Content-Digest": "sha256:" + hashlib.sha256(body).hexdigest(),
        }), body, url)

    def is_insecure(self, netloc: str) -> bool:
        return False


def _json(status: int, value: dict) -> Reply:
    return Reply(status, json.dumps(value).encode())


def _fill(resolver, request) -> Reply:
    spec = json.loads(request.body)
    template = parse_reference(spec["template"])
    real = resolver.http.get(
        f"https://{template.api_host}/v2/{template.repository}/manifests/{template.tag}",
        headers={"Accept": manifests.ACCEPT}, deadline=time.monotonic() + 10, max_bytes=4 << 20)
    if real.status != 200:
        return _json(502, {"error": f"template manifest: HTTP {real.status}"})
    images, per_pod, failed = spec["images"], int(spec["per_pod"]), 0
    # The client the resolver's access layer calls (registry/access.py): replaced for the fill.
    network_client = resolver.access.client
    resolver.access.client = oci.RegistryClient(_ReplayedRegistry(real), resolver.settings)
    try:
        for i in range(0, len(images), per_pod):
            results = resolver.resolve_many(images[i:i + per_pod], timeout=30)
            failed += sum(1 for r in results.values() if not hasattr(r, "architectures"))
    finally:
        resolver.access.client = network_client
    return _json(200, {"filled": len(images) - failed, "failed": failed,
                       "cache_entries": resolver.cache_size})


def main(argv=None) -> int:
    return cli.main(argv, extend=_add_fill_route)


if __name__ == "__main__":
    sys.exit(main())
