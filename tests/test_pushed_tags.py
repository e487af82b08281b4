"""What a push event sets off after the listener (webhook/registryevents.py), against the real
registry: Resolver.pushed checks each cached answer of the tag at once with the credentials that
read it and offers the new answer to the cluster's records; a tag nobody asked for costs
nothing; and the leader's tag watch raises ArchitecturesDropped when a record moved by another
replica's check says so (ImageRecords.moves), without a round of its own."""
import threading
import time
from concurrent.futures import wait

from archway.config import CacheSettings, RegistrySettings, RemediationSettings
from archway.gate.tagwatch import TagWatch, tag_key
from archway.objects.imagerecords import ImageRecords
from archway.objects.records import record_object, stored_record
from archway.placement.policy import Policy
from archway.registry.credentials import Keyring
from archway.registry.records import CLUSTER, ImageRecord
from archway.registry.resolver import Resolver
from tests.infra.fixtures import LOOPBACK_HOSTS, basic_auth_registry, plain_registry
from tests.test_cache import settle
from tests.test_image_records import DictRecords
from tests.test_tag_watch import Events, Secrets, Workloads, deployment

HOUR = CacheSettings(tag_ttl_seconds=3600)


def test_a_pushed_tag_is_checked_at_once_with_the_credentials_that_read_it(basic_auth_registry):
    reg = basic_auth_registry
    reg.push_image("push/private", "v1", "linux/amd64")
    image = reg.ref("push/private", "v1")
    records = DictRecords()
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, ca_file=reg.ca.cert_path,
                                         timeout_seconds=2, cache=HOUR))
    resolver.records = records
    keyring = Keyring.from_dockerconfigjson(reg.dockerconfigjson())
    before = resolver.resolve_many([image], keyring=keyring, timeout=5, scope="team-a")[image]
    assert before.architectures == {"amd64"}
    moved = reg.push_image("push/private", "v1", "linux/arm64")
    mark = reg.mark()
    flights = resolver.pushed(reg.host, "push/private", "v1")
    assert len(flights) == 1 and not wait(flights, timeout=10).not_done
    # A HEAD saw the digest move, a GET read the new content: both with team-a's secret.
    asked = [(e.method, e.status) for e in reg.manifest_gets(mark, "push/private")]
    assert ("HEAD", 200) in asked and ("GET", 200) in asked, asked
    mark = reg.mark()
    after = resolver.resolve_many([image], keyring=keyring, timeout=5, scope="team-a")[image]
    assert after.architectures == {"arm64"} and after.digest == moved
    assert reg.requests_since(mark) == []             # from the cache, within the hour's TTL
    assert [(o.scope, o.digest) for o in records.offers][-1] == ("team-a", moved)


def test_a_push_of_a_tag_nobody_asked_for_or_of_another_host_costs_no_request(plain_registry):
    reg = plain_registry
    reg.push_image("push/used", "v1", "linux/amd64")
    resolver = Resolver(RegistrySettings(allow_hosts=LOOPBACK_HOSTS, insecure_hosts=(reg.host,),
                                         timeout_seconds=2, cache=HOUR))
    resolver.resolve(reg.ref("push/used", "v1"), deadline=time.monotonic() + 10)
    mark = reg.mark()
    assert resolver.pushed(reg.host, "push/unused", "v1") == []
    assert resolver.pushed(reg.host, "push/used", "v2") == []
    assert resolver.pushed(reg.host, "used", "v1") == []           # not a suffix match
    assert reg.requests_since(mark) == []
    # A sender naming the registry otherwise (an in-cluster name, say): still the one cached.
    flights = resolver.pushed("registry.internal:5000", "push/used", "v1")
    assert len(flights) == 1 and not wait(flights, timeout=10).not_done
    assert [e.method for e in reg.manifest_gets(mark, "push/used")] == ["HEAD"]


def test_a_record_moved_by_another_replica_raises_the_alarm_at_once(plain_registry):
    reg = plain_registry
    first = reg.push_index("push/web", "v1", ["linux/amd64", "linux/arm64"]).digest
    image = reg.ref("push/web", "v1")
    resolver = Resolver(RegistrySettings(insecure_hosts=(reg.host,), timeout_seconds=2,
                                         cache=HOUR))
    records = ImageRecords.build(lambda: None, refresh_seconds=60, max_pending=10)
    events = Events()
    tags = TagWatch(api=None, settings=RemediationSettings(learn_failed_architectures=False),
                    policy=Policy(), events=events, workloads=Workloads(deployment("web", image)),
                    resolver=resolver, pull_secrets=Secrets(), records=records,
                    round_seconds=3600)
    old = resolver.resolve(image, deadline=time.monotonic() + 10)
    assert old.digest == first
    stop = threading.Event()
    leading = threading.Thread(target=tags.lead, args=(stop,), daemon=True)
    leading.start()
    try:
        end = time.monotonic() + 10
        while tags.rounds == 0:    # the first round (what the workloads use); the next in an hour
            assert time.monotonic() < end
            time.sleep(0.01)
        settle(resolver)
        # Pushed now: this leader's resolver sees nothing before its next round.
        moved = reg.push_image("push/web", "v1", "linux/amd64")
        new = Resolver(RegistrySettings(insecure_hosts=(reg.host,), timeout_seconds=2)).resolve(
            image, deadline=time.monotonic() + 10)
        # The watch of the records hears another replica's write, as a watch event arrives
        # (RecordWatch._upsert): the record before, then the one naming the new digest.
        for info, version in ((old, "1"), (new, "2")):
            obj = record_object(ImageRecord(CLUSTER, tag_key(image), info, time.time(),
                                            time.time()), resource_version=version)
            obj["metadata"]["resourceVersion"] = version
            records.cluster._upsert(stored_record(obj))
        alarms = [e for e in events.sent if e[3] == "ArchitecturesDropped"]
        assert [a[1] for a in alarms] == ["web"] and moved[:19] in alarms[0][4]
    finally:
        stop.set()
        leading.join(10)
    assert records.moves == []                   # the leadership's observer went with it
