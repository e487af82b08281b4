"""The cluster's image records as the resolver sees them (registry/records.py): read after the
process's cache and before the registry, offered after a registry read, scoped to the tenant
whose credentials read them, and dropped from the cache when a record says a tag moved;
against the real registry, counted at the server. The store here is the interface's simplest
implementation (a dict); the Kubernetes one is tested on the real control plane
(tests/e2e/test_image_records.py). Also the objects and the writer's decisions, pure."""
import json
import re
import time
from dataclasses import replace

from archway.config import CacheSettings, RegistrySettings
from archway.errors import AuthError
from archway.objects.records import record_object, stored_record
from archway.objects.recordwriter import merged, tells_more
from archway.registry.credentials import Keyring
from archway.registry.model import ImageInfo
from archway.registry.platforms import parse_platform
from archway.registry.records import CLUSTER, ImageRecord, record_name
from archway.registry.resolver import Resolver
from lab.clock import ManualClock
from tests.infra.fixtures import LOOPBACK_HOSTS, basic_auth_registry, plain_registry

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class DictRecords:
    """A RecordStore in a dict: what one process offers, every other process finds."""

    def __init__(self):
        self.by_key: dict[tuple[str, str], ImageRecord] = {}
        self.offers: list[ImageRecord] = []

    def find(self, scope, reference):
        return self.by_key.get((scope, reference))

    def offer(self, record):
        self.offers.append(record)
        self.by_key[(record.scope, record.reference)] = merged(
            self.by_key.get((record.scope, record.reference)), record)


def resolver_for(host, records, **cache) -> Resolver:
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(host,),
                                         timeout_seconds=2, cache=CacheSettings(**cache)),
                        clock=ManualClock())
    resolver.records = records
    return resolver


def test_a_second_process_answers_from_the_record_the_first_wrote_without_a_registry_request(
        plain_registry):
    plain_registry.push_index("rec/app", "v1", ["linux/amd64", "linux/arm64"])
    image = plain_registry.ref("rec/app", "v1")
    records = DictRecords()
    first = resolver_for(plain_registry.host, records).resolve(image, deadline=time.monotonic() + 10)
    (offered,) = records.offers
    assert offered.scope == CLUSTER and offered.digest == first.digest
    mark = plain_registry.mark()
    second = resolver_for(plain_registry.host, records)
    answer = second.resolve(image, deadline=time.monotonic() + 10)
    assert answer.architectures == {"amd64", "arm64"} and answer.digest == first.digest
    assert answer.image == image
    assert plain_registry.requests_since(mark) == []
    assert len(records.offers) == 1          # a record read from the store is not offered back


def test_a_record_past_the_tag_ttl_is_served_while_the_tag_is_checked_again(plain_registry):
    plain_registry.push_image("rec/old", "v1", "linux/arm64")
    image = plain_registry.ref("rec/old", "v1")
    records = DictRecords()
    resolver_for(plain_registry.host, records).resolve(image, deadline=time.monotonic() + 10)
    key = (CLUSTER, records.offers[0].reference)
    records.by_key[key] = replace(records.by_key[key], revalidated_at=time.time() - 400)
    mark = plain_registry.mark()
    second = resolver_for(plain_registry.host, records, tag_ttl_seconds=300)
    assert second.resolve(image, deadline=time.monotonic() + 10).architectures == {"arm64"}
    deadline = time.monotonic() + 10
    while time.time() - records.by_key[key].revalidated_at > 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.time() - records.by_key[key].revalidated_at < 60     # revalidated, offered
    requests = plain_registry.requests_since(mark)
    assert [r.method for r in requests if "/manifests/" in r.path] == ["HEAD"]


def test_a_stale_answer_takes_a_later_revalidation_from_the_record_instead_of_a_head(plain_registry):
    plain_registry.push_image("rec/fresh", "v1", "linux/amd64")
    image = plain_registry.ref("rec/fresh", "v1")
    records = DictRecords()
    worker = resolver_for(plain_registry.host, records, tag_ttl_seconds=300)
    worker.resolve(image, deadline=time.monotonic() + 10)
    worker._clock.now += 301                 # this process's answer is stale now...
    key = (CLUSTER, records.offers[0].reference)
    records.by_key[key] = replace(records.by_key[key], revalidated_at=time.time())  # ...the leader's is not
    mark = plain_registry.mark()
    assert worker.resolve(image, deadline=time.monotonic() + 10).architectures == {"amd64"}
    time.sleep(0.3)
    assert plain_registry.requests_since(mark) == []


def test_a_record_that_names_a_new_digest_replaces_the_cached_answer_at_once(plain_registry):
    plain_registry.push_image("rec/moves", "v1", "linux/amd64")
    image = plain_registry.ref("rec/moves", "v1")
    records = DictRecords()
    worker = resolver_for(plain_registry.host, records)
    assert worker.resolve(image, deadline=time.monotonic() + 10).architectures == {"amd64"}
    # Another process saw the tag re-pushed for arm64 and wrote the record.
    plain_registry.push_image("rec/moves", "v1", "linux/arm64")
    moved = resolver_for(plain_registry.host, DictRecords()).resolve(
        image, deadline=time.monotonic() + 10)
    reference = records.offers[0].reference
    records.by_key[(CLUSTER, reference)] = ImageRecord(CLUSTER, reference, moved, time.time(),
                                                       time.time())
    # Its watch tells this process: the old digest's answer goes, the record answers.
    assert worker.record_changed(reference, moved.digest) == 1
    mark = plain_registry.mark()
    assert worker.resolve(image, deadline=time.monotonic() + 10).architectures == {"arm64"}
    assert plain_registry.requests_since(mark) == []
    assert worker.record_changed(reference, moved.digest) == 0    # the same digest: kept


def test_a_record_read_with_a_namespaces_secret_is_served_only_in_that_namespace(basic_auth_registry):
    reg = basic_auth_registry
    reg.push_image("rec/private", "v1", "linux/arm64")
    image = reg.ref("rec/private", "v1")
    records = DictRecords()

    def resolver():
        r = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=reg.ca.cert_path,
                                      timeout_seconds=2))
        r.records = records
        return r
    keyring = Keyring.from_dockerconfigjson(reg.dockerconfigjson())
    found = resolver().resolve_many([image], keyring=keyring, timeout=5, scope="team-a")[image]
    assert isinstance(found, ImageInfo)
    (offered,) = records.offers
    assert offered.scope == "team-a"          # not CLUSTER: read with team-a's secret
    # Another namespace, without the secret or with one of its own: never team-a's record.
    assert isinstance(resolver().resolve_many([image], timeout=5, scope="team-b")[image], AuthError)
    mark = reg.mark()
    resolver().resolve_many([image], keyring=keyring, timeout=5, scope="team-b")
    assert [r for r in reg.requests_since(mark) if "/manifests/" in r.path]   # its own read
    # The same namespace, in another process: the record.
    mark = reg.mark()
    again = resolver().resolve_many([image], keyring=keyring, timeout=5, scope="team-a")[image]
    assert isinstance(again, ImageInfo) and reg.requests_since(mark) == []
    # Credentials of no known tenant: neither read nor written.
    before = len(records.offers)
    resolver().resolve_many([image], keyring=keyring, timeout=5)
    assert len(records.offers) == before


def _record(digest="sha256:" + "a" * 64, **changes) -> ImageRecord:
    info = ImageInfo("registry.example/team/app:v1",
                     frozenset({parse_platform("linux/arm64/v8"), parse_platform("linux/amd64")}),
                     digest, "oci-index")
    return replace(ImageRecord(CLUSTER, "registry.example/team/app:v1", info, 1000.0, 2000.0),
                   **changes)


def test_a_dry_run_admission_is_placed_from_the_registry_and_writes_no_record(plain_registry):
    """The webhook declares sideEffects: None: `kubectl create --dry-run=server` writes nothing."""
    from tests.test_service import review, service
    plain_registry.push_image("rec/dry", "v1", "linux/arm64")
    image = plain_registry.ref("rec/dry", "v1")
    records = DictRecords()
    admission = service(resolver_for(plain_registry.host, records), deadline_seconds=10)
    body = json.loads(review(image))
    body["request"]["dryRun"] = True
    answer = admission.review(json.dumps(body).encode()).body["response"]
    assert answer["auditAnnotations"]["architectures"] == "arm64"
    assert records.offers == []
    plain_registry.push_image("rec/dry", "v2", "linux/arm64")
    admission.review(review(plain_registry.ref("rec/dry", "v2")))
    assert [r.reference for r in records.offers] == [plain_registry.ref("rec/dry", "v2")]


def test_a_record_dated_in_the_future_is_not_fresh_on_its_own_word(plain_registry):
    """A replica whose clock runs fast (or an admin's hand) wrote lastRevalidated an hour ahead,
    then the tag was re-pushed arm64-only: the record counts as stale, the registry is asked."""
    plain_registry.push_image("rec/ahead", "v1", "linux/amd64")
    image = plain_registry.ref("rec/ahead", "v1")
    records = DictRecords()
    resolver_for(plain_registry.host, records).resolve(image, deadline=time.monotonic() + 10)
    (offered,) = records.offers
    ahead = time.time() + 3600
    stored = stored_record(record_object(replace(offered, read_at=ahead, revalidated_at=ahead)))
    assert stored is not None and stored.record.revalidated_at == stored.record.read_at == 0
    near = time.time() + 2                  # within replicas' clock skew: believed, up to now
    kept = stored_record(record_object(replace(offered, revalidated_at=near)), now=near - 2)
    assert kept is not None and kept.record.revalidated_at == near - 2
    plain_registry.push_image("rec/ahead", "v1", "linux/arm64")
    records.by_key[(CLUSTER, offered.reference)] = stored.record
    second = resolver_for(plain_registry.host, records, tag_ttl_seconds=3600)
    assert second.confirmed_at(image) == 0          # the leader's tag watch checks it
    assert second.resolve(image, deadline=time.monotonic() + 10).architectures == {"arm64"}


def test_record_names_are_dns_subdomains_and_unique_per_reference():
    for reference in ("registry.example/team/app@sha256:" + "a" * 64, "Reg:5000/A_b/c:V1.0_x",
                      "x" * 600, "registry.example/team/app:v1"):
        name = record_name(reference)
        assert DNS_SUBDOMAIN.match(name) and len(name) <= 253, name
    assert record_name("r/a:v_1") != record_name("r/a:v-1")


def test_a_record_survives_its_object_and_a_renamed_object_is_not_trusted():
    record = _record(scope="team-a", last_error="429 Too Many Requests")
    obj = record_object(record, "17")
    assert obj["kind"] == "ImageRecord" and obj["metadata"]["namespace"] == "team-a"
    assert obj["spec"]["architectures"] == "amd64,arm64"
    stored = stored_record(obj)
    assert stored is not None and stored.resource_version == "17"
    assert stored.record.info.platforms == record.info.platforms
    assert stored.record == replace(record, info=replace(record.info, image=record.reference))
    assert record_object(_record())["kind"] == "ClusterImageRecord"
    obj["metadata"]["name"] = record_name("registry.example/other:v1")
    assert stored_record(obj) is None
    assert stored_record({"metadata": {"name": "x"}, "spec": {"reference": 7}}) is None


def test_the_writer_writes_only_what_tells_the_others_something():
    known = _record()
    assert tells_more(None, known, 150)
    assert not tells_more(known, replace(known, revalidated_at=2100), 150)   # recent enough
    assert tells_more(known, replace(known, revalidated_at=2150), 150)       # refreshed
    assert tells_more(known, _record(digest="sha256:" + "b" * 64), 150)      # the tag moved
    failed = replace(known, last_error="timeout", revalidated_at=5000, read_at=5000)
    assert tells_more(known, failed, 150) and not tells_more(None, failed, 150)
    assert merged(known, failed) == replace(known, last_error="timeout")     # times kept
    again = merged(known, replace(known, read_at=3000, revalidated_at=3000))
    assert again.read_at == 1000 and again.revalidated_at == 3000


def test_the_leader_learns_when_a_record_was_last_confirmed_so_its_tag_watch_skips_fresh_ones(
        plain_registry):
    plain_registry.push_image("rec/confirmed", "v1", "linux/amd64")
    image = plain_registry.ref("rec/confirmed", "v1")
    records = DictRecords()
    resolver = resolver_for(plain_registry.host, records)
    assert resolver.confirmed_at(image) is None
    resolver.resolve(image, deadline=time.monotonic() + 10)
    assert abs(resolver.confirmed_at(image) - time.time()) < 30
    assert resolver.confirmed_at(image, Keyring.empty(), "team-a") == resolver.confirmed_at(image)
    assert Resolver().confirmed_at(image) is None      # no records: always checked


def test_the_leaders_round_revalidates_in_use_records_once_and_leaves_fresh_ones(plain_registry):
    from archway.gate.recordkeeper import RecordKeeper

    class Listed(DictRecords):
        def records(self):
            return list(self.by_key.values())
    plain_registry.push_image("rec/kept", "v1", "linux/amd64")
    plain_registry.push_image("rec/fresh2", "v1", "linux/amd64")
    images = [plain_registry.ref("rec/kept", "v1"), plain_registry.ref("rec/fresh2", "v1")]
    records = Listed()
    worker = resolver_for(plain_registry.host, records)
    for image in images:
        worker.resolve(image, deadline=time.monotonic() + 10)
    old_key = (CLUSTER, records.offers[0].reference)
    records.by_key[old_key] = replace(records.by_key[old_key], revalidated_at=time.time() - 200)
    pods = [{"kind": "Pod", "metadata": {"name": f"p{i}", "namespace": "shop"},
             "spec": {"containers": [{"name": "c", "image": image}]}} for i, image in enumerate(images)]
    leader = resolver_for(plain_registry.host, records)
    keeper = RecordKeeper(api=None, records=records, resolver=leader, list_objects=lambda: pods,
                          expire_seconds=3600, tag_ttl_seconds=300)
    mark = plain_registry.mark()
    assert keeper.round() == {"revalidated": 1, "deleted": 0}
    deadline = time.monotonic() + 10
    while time.time() - records.by_key[old_key].revalidated_at > 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.time() - records.by_key[old_key].revalidated_at < 60
    heads = [r for r in plain_registry.requests_since(mark) if "/manifests/" in r.path]
    assert [(r.method, "rec/kept" in r.path) for r in heads] == [("HEAD", True)]
