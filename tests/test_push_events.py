"""registry/pushevents.py: each sender's envelope read down to the tags that may have moved, and
nothing else believed; webhook/registryevents.py's rate limit per address.

The envelopes are the senders' documented shapes (distribution's as docker-registry 2.8 sends
it, measured: /work/shared/spec/registry-events.md); tests/test_registry_events.py has the real
registry's own.
"""
import json

import pytest

from archway.registry.pushevents import MAX_EVENTS, MalformedEvents, Push, parse
from archway.webhook.registryevents import SourceLimit

DIGEST = "sha256:" + "a" * 64


def read(value, content_type="application/json", **headers):
    body = value if isinstance(value, bytes) else json.dumps(value).encode()
    return parse(body, {"content-type": content_type, **headers})


def distribution(action="push", media_type="application/vnd.oci.image.index.v1+json", tag="v1",
                 method="PUT"):
    return {"id": "e1", "timestamp": "2026-12-03T06:00:00Z", "action": action,
            "target": {"mediaType": media_type, "digest": DIGEST, "size": 100,
                       "repository": "team/app", "tag": tag,
                       "url": f"http://registry.lab:5000/v2/team/app/manifests/{DIGEST}"},
            "request": {"id": "r1", "addr": "10.0.0.9:4000", "host": "registry.lab:5000",
                        "method": method, "useragent": "docker/27"},
            "actor": {}, "source": {"addr": "registry-0:5000", "instanceID": "i1"}}


def test_distribution_keeps_manifest_pushes_by_tag_and_ignores_pulls_blobs_and_deletes():
    envelope = {"events": [
        distribution(),
        distribution(media_type="application/vnd.docker.distribution.manifest.v2+json"),  # same tag
        distribution(action="pull", method="HEAD"),     # archway's own revalidation comes back
        distribution(action="pull", method="GET"),
        distribution(media_type="application/octet-stream", tag=""),   # a blob upload
        distribution(action="delete"),
        distribution(tag=""),                            # a push by digest: no tag moved
    ]}
    parsed = read(envelope, "application/vnd.docker.distribution.events.v1+json")
    assert parsed.source == "distribution"
    assert parsed.pushes == (Push("registry.lab:5000", "team/app", "v1"),)
    assert parsed.ignored == 5


def test_harbor_json_and_its_cloudevents():
    harbor = {"type": "PUSH_ARTIFACT", "occur_at": 1700000000, "operator": "admin",
              "event_data": {"resources": [
                  {"digest": DIGEST, "tag": "v2",
                   "resource_url": "harbor.example.com/library/app:v2"}],
                  "repository": {"name": "app", "namespace": "library",
                                 "repo_full_name": "library/app", "repo_type": "private"}}}
    parsed = read(harbor)
    assert (parsed.source, parsed.pushes) == ("harbor", (Push("harbor.example.com", "library/app", "v2"),))
    assert read({**harbor, "type": "DELETE_ARTIFACT"}).pushes == ()
    cloud = {"specversion": "1.0", "id": "x", "source": "/projects/1/webhook/policies/2",
             "type": "harbor.artifact.pushed", "datacontenttype": "application/json",
             "data": harbor["event_data"]}
    parsed = read(cloud, "application/cloudevents+json")
    assert (parsed.source, parsed.pushes) == ("cloudevents", (Push("harbor.example.com", "library/app", "v2"),))


def test_cloudevents_binary_mode_and_zot():
    data = {"name": "team/app", "reference": "v3", "digest": DIGEST,
            "mediaType": "application/vnd.oci.image.manifest.v1+json"}
    parsed = read(data, "application/json", **{"ce-specversion": "1.0", "ce-id": "1",
                                                "ce-type": "zotregistry.image.updated",
                                                "ce-source": "zot"})
    assert parsed.pushes == (Push("", "team/app", "v3"),)
    structured = {"specversion": "1.0", "id": "1", "source": "zot",   # zot's typePrefix set
                  "type": "com.example.registry.image.updated", "data": json.dumps(data)}
    assert read([structured, structured], "application/cloudevents-batch+json").pushes == (
        Push("", "team/app", "v3"),)
    by_digest = {**structured, "data": {**data, "reference": DIGEST}}
    assert read(by_digest).pushes == ()
    assert read({**structured, "type": "zotregistry.image.deleted"}).ignored == 1


def test_ecr_eventbridge_and_acr_event_grid():
    ecr = {"version": "0", "detail-type": "ECR Image Action", "source": "aws.ecr",
           "account": "111122223333", "region": "eu-west-1",
           "detail": {"result": "SUCCESS", "repository-name": "team/app", "image-digest": DIGEST,
                      "action-type": "PUSH", "image-tag": "v4"}}
    assert read(ecr).pushes == (Push("111122223333.dkr.ecr.eu-west-1.amazonaws.com", "team/app", "v4"),)
    assert read({**ecr, "detail": {**ecr["detail"], "result": "FAILURE"}}).pushes == ()
    acr = [{"id": "1", "eventType": "Microsoft.ContainerRegistry.ImagePushed",
            "data": {"target": {"repository": "team/app", "tag": "v5", "digest": DIGEST},
                     "request": {"host": "corp.azurecr.io", "method": "PUT"}}}]
    assert read(acr).pushes == (Push("corp.azurecr.io", "team/app", "v5"),)
    assert read([{**acr[0], "eventType": "Microsoft.ContainerRegistry.ImageDeleted"}]).pushes == ()


@pytest.mark.parametrize("body, reason", [
    (b"{", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[]", "not an event envelope"),
    (b"null", "not an event envelope"),
    (b'{"events": {}}', '"events" list'),
    (b'{"events": [1]}', "event 0 is not a JSON object"),
    (json.dumps({"events": [distribution()] * (MAX_EVENTS + 1)}).encode(), "at most 1000"),
])
def test_malformed_envelopes_say_why(body, reason):
    with pytest.raises(MalformedEvents) as caught:
        parse(body, {"content-type": "application/json"})
    assert reason in str(caught.value)


def test_what_no_image_reference_could_name_is_dropped():
    bad = [distribution(tag="-x"), distribution(tag="a" * 129), distribution(tag="v1/../x")]
    parsed = read({"events": bad})
    assert parsed.pushes == () and parsed.ignored == 3


def test_the_source_limit_refills_and_keeps_addresses_apart():
    now = [0.0]
    limit = SourceLimit(2.0, clock=lambda: now[0])   # bursts of 4
    assert [limit.admit("10.0.0.1") for _ in range(4)] == [0.0] * 4
    assert limit.admit("10.0.0.1") == pytest.approx(0.5)
    assert limit.admit("10.0.0.2") == 0.0
    now[0] += 0.5
    assert limit.admit("10.0.0.1") == 0.0
