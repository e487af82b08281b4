"""Hostile bodies against both parsers, through a worker's real routes (archway.main.worker):
POST /mutate (AdmissionReview) and the extender's /scheduler/filter and /scheduler/prioritize
(ExtenderArgs) must answer 4xx with a message, or 200, and never 5xx (issue 16 item 8).

The strategies start from the real fixtures and break them at any depth (replace any value
with any JSON value, drop keys, add keys), plus raw byte soup and the four bodies that used to
give a 500. The resolver is a stand-in that knows no image (no network here): what is fuzzed
is parsing and shape-checking, which happen before any lookup.
"""
import copy
import json
import logging
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from archway.config import config_from_dict
from archway.main.worker import build_worker
from tests.infra.siteclient import SiteClient

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _fixture(*parts: str) -> dict:
    with open(os.path.join(FIXTURES, *parts)) as f:
        return json.load(f)


ADMISSION = [_fixture("admission", name) for name in sorted(os.listdir(
    os.path.join(FIXTURES, "admission"))) if name.endswith(".json")]
EXTENDER = [_fixture("extender", name) for name in
            ("filter-nodenames.json", "filter-nodes.json", "filter-unannotated-nodes.json")]


class _NoImages:
    """Knows no image: every lookup answers nothing (the pod is admitted unchanged)."""
    cache_size = 0

    def resolve_many(self, images, **_kw):
        return {}


@pytest.fixture(scope="module")
def client():
    config = config_from_dict({"kubernetes": {"enabled": "off"},
                               "extender": {"node_cache": False},
                               "admission": {"fail_closed": True}})
    logging.getLogger("archway").setLevel(logging.CRITICAL)   # thousands of 400 lines
    try:
        yield SiteClient(build_worker(config, resolver=_NoImages()))
    finally:
        logging.getLogger("archway").setLevel(logging.NOTSET)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10),
                                                                      children, max_size=4),
    max_leaves=12)


@st.composite
def broken(draw, documents):
    """One fixture with a few values anywhere in it replaced, removed or added."""
    doc = copy.deepcopy(draw(st.sampled_from(documents)))
    for _ in range(draw(st.integers(1, 4))):
        path, node = [], doc
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict)
                                       else range(len(node))))
            path.append((node, key))
            node = node[key]
        if not path:
            continue
        parent, key = path[-1]
        action = draw(st.sampled_from(("replace", "drop", "add")))
        if action == "drop" and isinstance(parent, dict):
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = draw(JSON)
        else:
            parent[key] = draw(JSON)
    return doc


def _check(response) -> None:
    assert response.status_code < 500, response.get_data()[:500]
    if response.status_code >= 400:
        error = response.get_json()["error"]
        assert isinstance(error, str) and error.strip()


SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@SETTINGS
@given(doc=broken(ADMISSION))
def test_broken_admission_reviews_are_answered_or_refused_with_a_message(client, doc):
    _check(client.post("/mutate", data=json.dumps(doc), content_type="application/json"))


@SETTINGS
@given(doc=broken(EXTENDER), verb=st.sampled_from(("filter", "prioritize")))
def test_broken_extender_args_are_answered_or_refused_with_a_message(client, doc, verb):
    _check(client.post(f"/scheduler/{verb}", data=json.dumps(doc),
                       content_type="application/json"))


@SETTINGS
@given(body=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()),
       path=st.sampled_from(("/mutate", "/scheduler/filter", "/scheduler/prioritize")))
def test_any_bytes_are_answered_or_refused_with_a_message(client, body, path):
    _check(client.post(path, data=body, content_type="application/json"))


# The bodies the attack run found answered with a 500 (or an internal-error decision).
def test_deeply_nested_json_is_a_400(client):
    deep = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":' + \
        b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("/mutate", data=deep, content_type="application/json")
    assert r.status_code == 400 and "nests too deeply" in r.get_json()["error"]


@pytest.mark.parametrize("where", ["Pod", "Nodes"])
def test_an_integer_of_5000_digits_is_a_400_on_the_extender(client, where):
    doc = copy.deepcopy(EXTENDER[1])
    if where == "Pod":
        doc["Pod"]["metadata"]["generation"] = 0
    else:
        doc["Nodes"]["items"][0]["metadata"]["generation"] = 0
    body = json.dumps(doc).replace('"generation": 0', '"generation": ' + "9" * 5000).encode()
    r = client.post("/scheduler/filter", data=body, content_type="application/json")
    assert r.status_code == 400 and "4300 digits" in r.get_json()["error"]


def test_a_non_pod_review_whose_metadata_is_not_an_object_is_answered(client):
    doc = next(d for d in ADMISSION if d["request"].get("kind", {}).get("kind") == "ConfigMap")
    doc = copy.deepcopy(doc)
    doc["request"]["object"]["metadata"] = "x"
    r = client.post("/mutate", data=json.dumps(doc), content_type="application/json")
    assert r.status_code == 200 and r.get_json()["response"]["allowed"] is True


def test_a_pod_with_null_metadata_is_decided_not_an_internal_error(client):
    """fail_closed is on in this app: an internal error would deny the pod."""
    body = copy.deepcopy(next(d for d in ADMISSION if d["request"].get("kind", {}).get("kind")
                              == "Pod" and d["request"].get("operation") == "CREATE"))
    body["request"]["object"]["metadata"] = None
    r = client.post("/mutate", data=json.dumps(body), content_type="application/json")
    assert r.status_code == 200, r.get_data()
    response = r.get_json()["response"]
    assert "internal error" not in json.dumps(response)
