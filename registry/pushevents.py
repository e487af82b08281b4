"""What a registry's push notification says: which repository's tag may have moved.

An event is never trusted: it is a hint, checked at the registry itself (Resolver.pushed).
So only what names a tag is kept (host, repository, tag); digests and media types an event
carries are not believed, and anything but a push of a tagged manifest is ignored. Above all a
pull: the registry sends one for each of archway's own HEADs, and a listener that reacted to
them would feed itself.

    distribution   application/vnd.docker.distribution.events.v1+json: {"events": [...]},
                   action push, target {repository, tag, mediaType}, request.host
    Harbor         its own JSON: type PUSH_ARTIFACT, event_data {resources[].{tag, resource_url},
                   repository.repo_full_name}
    CloudEvents    1.0, structured (application/cloudevents+json, or a batch) or binary (ce-*
                   headers, the body is `data`): Harbor's harbor.artifact.pushed, zot's
                   zotregistry.image.updated (data {name, reference}), Event Grid's
                   Microsoft.ContainerRegistry.ImagePushed
    EventBridge    ECR's "ECR Image Action" (detail {action-type PUSH, repository-name, image-tag})
    Event Grid     its own schema: a list of {eventType ImagePushed, data {target, request}}
"""
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from archway.errors import ArchwayError, ConfigError

DISTRIBUTION = "application/vnd.docker.distribution.events.v1+json"
CLOUDEVENTS = "application/cloudevents+json"
CLOUDEVENTS_BATCH = "application/cloudevents-batch+json"
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")   # as image references spell a tag
MAX_EVENTS = 1000          # per request: a larger batch is refused, not half read
_MANIFEST_HINTS = ("manifest", "index")   # a blob's mediaType is application/octet-stream etc.
_PUSH_TYPES = ("harbor.artifact.pushed", "Microsoft.ContainerRegistry.ImagePushed")
# zot's: zotregistry.image.updated, under the operator's own prefix when `typePrefix` is set
_ZOT_PUSHES = (".image.updated", ".image.created")


def read_token(path: str) -> str:
    """registry.events.token_file's bearer token (checked by `archway serve` before the
    workers start, so it imports nothing that records metrics)."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ConfigError(f"registry.events.token_file {path}: {e.strerror}") from None
    if not token:
        raise ConfigError(f"registry.events.token_file {path} is empty")
    return token


class MalformedEvents(ArchwayError):
    """The body is not an envelope archway reads: a 400 with this reason."""


@dataclass(frozen=True, slots=True)
class Push:
    """A tag that may name another digest now. `host`: the registry as the sender names it
    ("" when it does not say)."""
    host: str
    repository: str
    tag: str


@dataclass(frozen=True)
class Parsed:
    source: str                # distribution, harbor, cloudevents, ecr, acr: the metric's label
    pushes: tuple[Push, ...]   # distinct, in order
    ignored: int               # events that name no pushed tag (pulls, blobs, deletes, ...)


def parse(body: bytes, headers: Mapping[str, str]) -> Parsed:
    """The pushes in one request (`headers`: lower-case names); MalformedEvents otherwise."""
    if "ce-specversion" in headers:   # CloudEvents' binary mode: attributes in headers
        event = {"specversion": headers["ce-specversion"], "type": headers.get("ce-type", ""),
                 "source": headers.get("ce-source", ""), "data": _json(body)}
        return _collect("cloudevents", [event], _cloudevent)
    value = _json(body)
    content_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == DISTRIBUTION or (isinstance(value, dict) and "events" in value):
        events = value.get("events") if isinstance(value, dict) else None
        if not isinstance(events, list):
            raise MalformedEvents("a distribution envelope needs an \"events\" list")
        return _collect("distribution", events, _distribution)
    events = value if isinstance(value, list) and value else [value]
    for source, marks, read in _FORMATS:
        if all(isinstance(e, dict) and marks(e) for e in events):
            return _collect(source, events, read)
    raise MalformedEvents("not an event envelope archway reads: distribution's "
                          f"({DISTRIBUTION}), Harbor's JSON, CloudEvents 1.0, ECR's EventBridge "
                          "or ACR's Event Grid events")


def _json(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedEvents(f"the body is not JSON ({e})") from None


def _collect(source: str, events: list, read) -> Parsed:
    if len(events) > MAX_EVENTS:
        raise MalformedEvents(f"{len(events)} events in one request; archway reads at most "
                              f"{MAX_EVENTS}")
    pushes: dict[Push, None] = {}
    ignored = 0
    for n, event in enumerate(events):
        if not isinstance(event, dict):
            raise MalformedEvents(f"event {n} is not a JSON object")
        found = [p for p in read(event) if _valid(p)]
        ignored += not found
        pushes.update(dict.fromkeys(found))
    return Parsed(source, tuple(pushes), ignored)


def _valid(push: Push) -> bool:
    return bool(push.repository) and TAG.fullmatch(push.tag) is not None and \
        len(push.repository) <= 255 and len(push.host) <= 255


def _text(value) -> str:
    return value.strip() if isinstance(value, str) else ""


def _obj(value) -> dict:
    return value if isinstance(value, dict) else {}


def _distribution(event: dict) -> list[Push]:
    target = _obj(event.get("target"))
    media_type = _text(target.get("mediaType")).lower()
    if event.get("action") != "push" or not any(h in media_type for h in _MANIFEST_HINTS):
        return []
    return [Push(_text(_obj(event.get("request")).get("host")), _text(target.get("repository")),
                 _text(target.get("tag")))]


def _harbor(event: dict) -> list[Push]:
    """Harbor's own payload, or its CloudEvents `data` (the same event_data)."""
    if _text(event.get("type")) not in ("PUSH_ARTIFACT", "pushImage"):
        return []
    return _harbor_data(_obj(event.get("event_data")))


def _harbor_data(data: dict) -> list[Push]:
    repository = _text(_obj(data.get("repository")).get("repo_full_name"))
    pushes = []
    for resource in data.get("resources") or ():
        resource = _obj(resource)
        # resource_url: harbor.example.com/library/app:v1: the host the cluster pulls from
        host = _text(resource.get("resource_url")).split("/", 1)[0]
        pushes.append(Push(host if "." in host or ":" in host else "", repository,
                           _text(resource.get("tag"))))
    return pushes


def _cloudevent(event: dict) -> list[Push]:
    kind = _text(event.get("type"))
    if kind not in _PUSH_TYPES and not kind.endswith(_ZOT_PUSHES):
        return []
    data = event.get("data")
    if isinstance(data, str):   # a structured event's data may be JSON text
        try:
            data = json.loads(data)
        except ValueError:
            return []
    data = _obj(data)
    if kind == "harbor.artifact.pushed":
        return _harbor_data(data)
    if kind.startswith("Microsoft."):
        return _event_grid({"eventType": kind, "data": data})
    # zot: {name, reference, digest, mediaType}; the host is the one the sender runs on
    reference = _text(data.get("reference"))
    return [Push("", _text(data.get("name")), reference)] if not reference.startswith("sha256:") \
        else []


def _ecr(event: dict) -> list[Push]:
    detail = _obj(event.get("detail"))
    if detail.get("action-type") != "PUSH" or detail.get("result", "SUCCESS") != "SUCCESS":
        return []
    account, region = _text(event.get("account")), _text(event.get("region"))
    host = f"{account}.dkr.ecr.{region}.amazonaws.com" if account and region else ""
    return [Push(host, _text(detail.get("repository-name")), _text(detail.get("image-tag")))]


def _event_grid(event: dict) -> list[Push]:
    if event.get("eventType") != "Microsoft.ContainerRegistry.ImagePushed":
        return []
    data = _obj(event.get("data"))
    target = _obj(data.get("target"))
    return [Push(_text(_obj(data.get("request")).get("host")), _text(target.get("repository")),
                 _text(target.get("tag")))]


# (source, whether an event is of that format, its reader); a batch is a JSON list of them.
_FORMATS = (
    ("cloudevents", lambda e: "specversion" in e, _cloudevent),
    ("harbor", lambda e: "event_data" in e, _harbor),
    ("ecr", lambda e: e.get("detail-type") == "ECR Image Action", _ecr),
    ("acr", lambda e: "eventType" in e, _event_grid),
)
