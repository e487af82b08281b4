"""The pure placement decision: table-driven cases and hypothesis properties."""
import copy
import json

import jsonpatch
import kubernetes_validate
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from archway.errors import (
    AuthError,
    DeadlineExceeded,
    HostRefused,
    NotFound,
    PeerRefused,
    RegistryError,
    TransportError,
)
from archway.placement import archset, patches
from archway.placement import decision as placement
from archway.placement.patches import json_patch
from archway.placement.policy import Policy
from archway.podview import PodShapeError, PodView
from archway.registry.model import ImageInfo
from archway.registry.platforms import normalize, parse_platform
from archway.vocabulary import ANNOTATION_ARCHITECTURES, ANNOTATION_IMAGES, ARCH_LABEL
from archway.webhook.admission import MAX_WARNING_CHARS, MAX_WARNINGS, cap_warnings

SCHEMA_VERSIONS = ("1.30.0", "1.33.0")
ALL_ARCHS = frozenset({"amd64", "arm64", "arm", "ppc64le", "s390x", "riscv64"})


def decide(pod: dict, results, policy, **kw):
    """placement.decide on the view of a pod written as a dict."""
    return placement.decide(PodView.of(pod), results, policy, **kw)


def pod_arch_constraint(pod: dict):
    return archset.pod_arch_constraint(PodView.of(pod))


def info(image, *platforms, source="oci-index"):
    return ImageInfo(image, frozenset(parse_platform(p) for p in platforms), "sha256:" + "0" * 64,
                     source)


def make_pod(*images, init=(), node_selector=None, affinity=None, scheduler=None,
             annotations=None, name="p"):
    spec = {"containers": [{"name": f"c{i}", "image": im} for i, im in enumerate(images)]}
    if init:
        spec["initContainers"] = [{"name": f"i{i}", "image": im} for i, im in enumerate(init)]
    if node_selector is not None:
        spec["nodeSelector"] = node_selector
    if affinity is not None:
        spec["affinity"] = affinity
    if scheduler is not None:
        spec["schedulerName"] = scheduler
    metadata = {"name": name, "namespace": "default"}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def required(*terms):
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}


def expr(key, operator, *values):
    e = {"key": key, "operator": operator}
    if values:
        e["values"] = list(values)
    return e


def term(*expressions, fields=()):
    t = {}
    if expressions:
        t["matchExpressions"] = list(expressions)
    if fields:
        t["matchFields"] = list(fields)
    return t


def applied(pod, decision):
    mutated = jsonpatch.apply_patch(pod, list(decision.patch))
    return mutated


def validate(pod):
    for version in SCHEMA_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)


def terms_of(pod):
    return pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]


MULTI = info("reg/multi:1", "linux/amd64", "linux/arm64", "linux/arm/v7")
AMD = info("reg/amd:1", "linux/amd64")
ARM = info("reg/arm:1", "linux/arm64")
AMD_ARM = info("reg/amdarm:1", "linux/amd64", "linux/arm64")
RESULTS = {i.image: i for i in (MULTI, AMD, ARM, AMD_ARM)}


# --- table: how the constraint is written -----------------------------------------------------

def test_multi_arch_image_gets_one_required_term():
    pod = make_pod("reg/multi:1")
    d = decide(pod, RESULTS, Policy())
    assert d.allowed and d.outcome == "mutated" and not d.warnings
    assert d.architectures == {"amd64", "arm64", "arm"}
    out = applied(pod, d)
    assert terms_of(out) == [{"matchExpressions": [
        {"key": ARCH_LABEL, "operator": "In", "values": ["amd64", "arm", "arm64"]}]}]
    assert out["metadata"]["annotations"][ANNOTATION_ARCHITECTURES] == "amd64,arm,arm64"
    assert json.loads(out["metadata"]["annotations"][ANNOTATION_IMAGES]) == [
        {"image": "reg/multi:1", "digest": MULTI.digest, "architectures": ["amd64", "arm", "arm64"],
         "source": "oci-index"}]
    assert "nodeSelector" not in out["spec"]
    validate(out)


def test_single_arch_without_affinity_uses_node_selector_with_escaped_pointer():
    pod = make_pod("reg/multi:1", "reg/arm:1", node_selector={"disktype": "ssd"},
                   annotations={"team": "a"})
    d = decide(pod, RESULTS, Policy())
    paths = {op["path"] for op in d.patch}
    assert "/spec/nodeSelector/kubernetes.io~1arch" in paths
    assert "/metadata/annotations/archway.dev~1architectures" in paths
    out = applied(pod, d)
    assert out["spec"]["nodeSelector"] == {"disktype": "ssd", ARCH_LABEL: "arm64"}
    assert "affinity" not in out["spec"]
    validate(out)


def test_init_containers_count():
    pod = make_pod("reg/multi:1", init=("reg/amd:1",))
    d = decide(pod, RESULTS, Policy())
    assert applied(pod, d)["spec"]["nodeSelector"] == {ARCH_LABEL: "amd64"}


def test_ephemeral_containers_are_not_images_of_a_new_pod():
    pod = make_pod("reg/multi:1")
    pod["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "reg/amd:1"}]
    assert PodView.of(pod).images == ("reg/multi:1",)


def test_single_arch_with_required_affinity_goes_into_every_term():
    pod = make_pod("reg/arm:1", affinity=required(
        term(expr("topology.kubernetes.io/zone", "In", "a")),
        term(expr("disktype", "In", "ssd"), expr("gpu", "DoesNotExist"))))
    d = decide(pod, RESULTS, Policy())
    out = applied(pod, d)
    arch = {"key": ARCH_LABEL, "operator": "In", "values": ["arm64"]}
    assert terms_of(out) == [
        {"matchExpressions": [expr("topology.kubernetes.io/zone", "In", "a"), arch]},
        {"matchExpressions": [expr("disktype", "In", "ssd"), expr("gpu", "DoesNotExist"), arch]}]
    assert "nodeSelector" not in out["spec"]
    validate(out)


def test_preferred_affinity_is_kept_and_required_is_added_beside_it():
    preferred = [{"weight": 5, "preference": term(expr("fast", "Exists"))}]
    pod = make_pod("reg/amdarm:1", affinity={"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": preferred}},
        node_selector={})
    out = applied(pod, decide(pod, RESULTS, Policy()))
    node_affinity = out["spec"]["affinity"]["nodeAffinity"]
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    assert len(terms_of(out)) == 1
    assert out["spec"]["nodeSelector"] == {}
    validate(out)


def test_match_fields_term_of_a_daemonset_pod_gains_the_arch_requirement():
    pin = {"key": "metadata.name", "operator": "In", "values": ["node-1"]}
    pod = make_pod("reg/amdarm:1", affinity=required(term(fields=[pin])))
    out = applied(pod, decide(pod, RESULTS, Policy()))
    assert terms_of(out) == [{"matchFields": [pin], "matchExpressions": [
        {"key": ARCH_LABEL, "operator": "In", "values": ["amd64", "arm64"]}]}]
    validate(out)


def test_a_term_that_matches_nothing_stays_empty():
    pod = make_pod("reg/amdarm:1", affinity=required(term(), term(expr("zone", "In", "a"))))
    out = applied(pod, decide(pod, RESULTS, Policy()))
    assert terms_of(out)[0] == {}
    assert terms_of(out)[1]["matchExpressions"][-1]["key"] == ARCH_LABEL


def test_term_already_holding_the_same_requirement_is_not_duplicated():
    same = expr(ARCH_LABEL, "In", "arm64", "amd64")
    pod = make_pod("reg/amdarm:1", affinity=required(term(same), term(expr("zone", "In", "a"))))
    out = applied(pod, decide(pod, RESULTS, Policy()))
    assert terms_of(out)[0] == term(same)
    assert len(terms_of(out)[1]["matchExpressions"]) == 2


# --- table: the pod's own arch constraint -------------------------------------------------------

@pytest.mark.parametrize("spec_part, expected", [
    ({"node_selector": {ARCH_LABEL: "arm64"}}, {"arm64"}),
    ({"node_selector": {"beta.kubernetes.io/arch": "amd64"}}, {"amd64"}),
    ({"affinity": required(term(expr(ARCH_LABEL, "In", "arm64")),
                           term(expr(ARCH_LABEL, "In", "amd64"), expr("z", "In", "a")))},
     {"amd64", "arm64"}),
    ({"affinity": required(term(expr(ARCH_LABEL, "NotIn", "s390x")))}, ALL_ARCHS - {"s390x"}),
    ({"affinity": required(term(expr(ARCH_LABEL, "In", "arm64")), term())}, {"arm64"}),
    ({"affinity": required(term(expr(ARCH_LABEL, "In", "amd64", "arm64"))),
      "node_selector": {ARCH_LABEL: "arm64"}}, {"arm64"}),
])
def test_pod_arch_constraint_is_recognised(spec_part, expected):
    constraint = pod_arch_constraint(make_pod("x", **spec_part))
    assert constraint is not None and constraint.within(ALL_ARCHS) == expected


@pytest.mark.parametrize("affinity", [
    required(term(expr(ARCH_LABEL, "In", "arm64")), term(expr("zone", "In", "a"))),
    required(term(expr(ARCH_LABEL, "Exists"))),
    required(term(fields=[{"key": "metadata.name", "operator": "In", "values": ["n1"]}])),
])
def test_affinity_that_does_not_restrict_every_term_is_not_a_constraint(affinity):
    assert pod_arch_constraint(make_pod("x", affinity=affinity)) is None


def test_existing_constraint_within_s_is_kept_and_only_annotated():
    pod = make_pod("reg/multi:1", node_selector={ARCH_LABEL: "arm64"})
    d = decide(pod, RESULTS, Policy())
    assert d.allowed and not d.warnings and d.reason == "pod already constrains kubernetes.io/arch"
    assert d.patch == ({"op": "add", "path": "/metadata/annotations",
                        "value": {ANNOTATION_ARCHITECTURES: "amd64,arm,arm64",
                                  ANNOTATION_IMAGES: patches.images_annotation(
                                      ["reg/multi:1"], RESULTS)}},)


def test_mixed_terms_all_gain_the_requirement():
    pod = make_pod("reg/amdarm:1", affinity=required(
        term(expr(ARCH_LABEL, "In", "arm64")), term(expr("zone", "In", "a"))))
    out = applied(pod, decide(pod, RESULTS, Policy()))
    assert [len(t["matchExpressions"]) for t in terms_of(out)] == [2, 2]


def test_conflicting_own_constraint_warns_or_denies():
    pod = make_pod("reg/amd:1", node_selector={ARCH_LABEL: "arm64"})
    d = decide(pod, RESULTS, Policy())
    assert d.allowed and len(d.warnings) == 1 and "excludes" in d.warnings[0]
    assert applied(pod, d)["spec"]["nodeSelector"] == {ARCH_LABEL: "arm64"}  # not overridden
    denied = decide(pod, RESULTS, Policy(deny_on_conflict=True))
    assert not denied.allowed and denied.patch == () and denied.outcome == "denied"
    assert "arm64" in denied.message and "amd64" in denied.message
    # admitted, denied or audited: the decision says why the pod can never run
    audited = decide(pod, RESULTS, Policy(mode="audit"))
    assert d.conflict == denied.conflict == audited.conflict == (
        "the pod's own kubernetes.io/arch constraint (arm64) excludes every architecture its "
        "images support (amd64)")
    fine = make_pod("reg/amdarm:1", node_selector={ARCH_LABEL: "arm64"})
    assert decide(fine, RESULTS, Policy()).conflict == ""


def test_own_constraint_wider_than_s_is_narrowed_to_s_and_says_so():
    """The two-architecture tier's find: an amd64-only image in a pod allowing amd64 and arm64
    was left so, landed on the arm64 node and crash-looped there, its replacements too (the
    workload's learned exclusion could not apply). archway ANDs its requirement into the pod's
    own terms: never wider than the pod said, never where its images cannot run."""
    pod = make_pod("reg/amd:1", affinity=required(term(expr(ARCH_LABEL, "In", "amd64", "arm64"))))
    d = decide(pod, RESULTS, Policy(deny_on_conflict=True))
    assert d.allowed and d.warnings == (
        "the pod's arch constraint also allows archs its images lack; archway keeps it to amd64",)
    patched = applied(pod, d)
    assert pod_arch_constraint(patched).within(frozenset({"amd64", "arm64", "s390x"})) == {"amd64"}
    assert terms_of(patched)[0]["matchExpressions"][0] == expr(ARCH_LABEL, "In", "amd64", "arm64")


# --- table: what the images say -----------------------------------------------------------------

def test_no_common_architecture_is_denied_with_each_image_listed():
    pod = make_pod("reg/amd:1", "reg/arm:1", "reg/multi:1")
    d = decide(pod, RESULTS, Policy())
    assert not d.allowed and d.patch == () and d.architectures == frozenset()
    assert d.message == ("the pod's images share no CPU architecture: reg/amd:1 (amd64); "
                         "reg/arm:1 (arm64); reg/multi:1 (amd64, arm, arm64)")


def test_no_common_architecture_admitted_by_config_has_no_constraint():
    pod = make_pod("reg/amd:1", "reg/arm:1")
    d = decide(pod, RESULTS, Policy(deny_on_empty=False, scheduler_name="archway"))
    assert d.allowed and "share no CPU architecture" in d.warnings[0]
    out = applied(pod, d)
    assert out["spec"] == {**pod["spec"], "schedulerName": "archway"}
    assert ANNOTATION_ARCHITECTURES not in out["metadata"]["annotations"]
    assert [i["architectures"] for i in json.loads(
        out["metadata"]["annotations"][ANNOTATION_IMAGES])] == [["amd64"], ["arm64"]]


def test_unresolved_image_does_not_shrink_s_and_warns():
    pod = make_pod("reg/amdarm:1", "reg/gone:1")
    results = {**RESULTS, "reg/gone:1": NotFound("gone", host="reg", repository="gone", status=404)}
    d = decide(pod, results, Policy())
    assert d.allowed and d.outcome == "fail_open" and d.architectures == {"amd64", "arm64"}
    assert d.warnings == ("could not inspect reg/gone:1 (not found); it does not restrict placement",)
    assert len(terms_of(applied(pod, d))) == 1


def test_every_image_unresolved_fails_open_without_constraint():
    pod = make_pod("reg/a:1", "reg/b:1")
    results = {"reg/a:1": DeadlineExceeded("slow"),
               "reg/b:1": AuthError("no", host="reg", status=401)}
    d = decide(pod, results, Policy())
    assert d.allowed and d.patch == () and d.outcome == "fail_open" and d.architectures is None
    assert [w.split(" (")[1].split(")")[0] for w in d.warnings] == [
        "registry unreachable", "registry refused the credentials"]


def test_missing_result_counts_as_no_answer():
    d = decide(make_pod("reg/slow:1"), {}, Policy())
    assert d.allowed and "(registry unreachable)" in d.warnings[0]   # as any network failure


def test_fail_closed_denies_and_names_the_images():
    pod = make_pod("reg/amd:1", "reg/down:1")
    results = {**RESULTS, "reg/down:1": TransportError("refused", host="reg")}
    d = decide(pod, results, Policy(fail_closed=True))
    assert not d.allowed and d.outcome == "denied"
    assert "reg/down:1: registry unreachable" in d.message and "unresolved is deny" in d.message


def test_image_with_unknown_architecture_does_not_shrink_s():
    empty = ImageInfo("reg/sif:1", frozenset(), None, "sif-oras", note="header arch 00")
    pod = make_pod("reg/amdarm:1", "reg/sif:1")
    d = decide(pod, {**RESULTS, "reg/sif:1": empty}, Policy(fail_closed=True))
    assert d.allowed and d.outcome == "mutated" and d.architectures == {"amd64", "arm64"}
    assert d.warnings == ("reg/sif:1 records no CPU architecture; it does not restrict placement",)


@pytest.mark.parametrize("error, words", [
    # Refused before any connection: the rule and the key that lifts it, never the message.
    (HostRefused("127.0.0.1:9 resolves to 127.0.0.1, secret", rule="loopback"),
     "refused by policy: loopback"),
    (HostRefused("x", rule="metadata"), "refused by policy: metadata service"),
    # Refused where the connection landed: as a network error, or it would scan ports.
    (PeerRefused("x", rule="cluster"), "registry unreachable"),
    (RegistryError("boom", host="r", status=500), "registry answered HTTP 500"),
    (RegistryError("boom", host="r"), "registry error"),
])
def test_error_words(error, words):
    d = decide(make_pod("reg/x:1"), {"reg/x:1": error}, Policy())
    assert f"({words})" in d.warnings[0]


def test_warnings_are_short_and_capped():
    long_image = "registry.example.com/" + "very-long-team-name/" * 8 + "app@sha256:" + "a" * 64
    images = [f"{long_image}{i}" for i in range(8)]
    d = decide(make_pod(*images), {im: DeadlineExceeded("x") for im in images}, Policy())
    assert len(d.warnings) == 8     # the decision keeps all; the reply caps them
    capped = cap_warnings(d.warnings)
    assert len(capped) == MAX_WARNINGS
    assert capped[-1] == "... and 4 more warnings from archway"
    assert all(len(w) <= MAX_WARNING_CHARS and w.isprintable() for w in capped)


def test_warnings_never_carry_control_characters():
    image = "reg/evil\r\nX-Injected: 1:1"
    d = decide(make_pod(image), {image: DeadlineExceeded("x")}, Policy())
    assert "\r" not in d.warnings[0] and "\n" not in d.warnings[0]


# --- table: schedulerName -------------------------------------------------------------------

@pytest.mark.parametrize("current, configured, expected", [
    (None, "archway-scheduler", "archway-scheduler"),
    ("default-scheduler", "archway-scheduler", "archway-scheduler"),
    ("", "archway-scheduler", "archway-scheduler"),
    ("volcano", "archway-scheduler", "volcano"),
    ("default-scheduler", None, "default-scheduler"),
])
def test_scheduler_name(current, configured, expected):
    pod = make_pod("reg/multi:1", scheduler=current)
    out = applied(pod, decide(pod, RESULTS, Policy(scheduler_name=configured)))
    assert out["spec"].get("schedulerName", None) == (expected if current is not None or configured
                                                      else None)


def test_scheduler_name_is_set_even_when_nothing_resolved():
    pod = make_pod("reg/x:1", scheduler="default-scheduler")
    d = decide(pod, {"reg/x:1": DeadlineExceeded("x")}, Policy(scheduler_name="archway"))
    assert applied(pod, d)["spec"]["schedulerName"] == "archway"


NEEDED = Policy(scheduler_name="archway", scheduler_for_pinned=False)   # placement.scheduler_for


@pytest.mark.parametrize("pod, node_oses, sent", [
    # pinned to its images' architectures by archway, on a cluster of linux nodes: left as is
    (make_pod("reg/arm:1"), frozenset({"linux"}), False),
    (make_pod("reg/multi:1", "reg/amdarm:1"), frozenset({"linux"}), False),
    # ... unless the cluster's nodes are not known, or some run another OS
    (make_pod("reg/arm:1"), None, True),
    (make_pod("reg/arm:1"), frozenset({"linux", "windows"}), True),
    # a pod that pins its OS itself needs no knowledge of the nodes
    (make_pod("reg/arm:1", node_selector={"kubernetes.io/os": "linux"}), None, False),
    # its own arch pin within its images' architectures is a pin too; one beyond them archway
    # narrows to them, a pin as well
    (make_pod("reg/amdarm:1", node_selector={ARCH_LABEL: "arm64"}), frozenset({"linux"}), False),
    (make_pod("reg/arm:1", affinity=required(term(expr(ARCH_LABEL, "In", "arm64", "amd64")))),
     frozenset({"linux"}), False),
    # an image not read: nothing is pinned, the extender reads it at scheduling time
    (make_pod("reg/x:1"), frozenset({"linux"}), True),
    (make_pod("reg/arm:1", "reg/x:1"), frozenset({"linux"}), True),
])
def test_a_pod_pinned_where_its_images_run_keeps_the_default_scheduler(pod, node_oses, sent):
    results = dict(RESULTS, **{"reg/x:1": DeadlineExceeded("x")})
    d = decide(pod, results, NEEDED, node_oses=node_oses)
    assert applied(pod, d)["spec"].get("schedulerName") == ("archway" if sent else None)
    assert (placement.PINNED_SCHEDULER in d.reason) == (not sent)
    # placement.scheduler_for: all (or an extender that scores or caps nodes): always sent
    d = decide(pod, results, Policy(scheduler_name="archway"), node_oses=node_oses)
    assert applied(pod, d)["spec"]["schedulerName"] == "archway"


@pytest.mark.parametrize("section, values, for_pinned", [
    ("placement", {}, False),
    ("placement", {"scheduler_for": "all"}, True),
    ("prometheus", {"url": "http://prometheus:9090"}, True),
    ("extender", {"max_utilisation": 0.8}, True),
])
def test_which_pods_get_the_scheduler_name_follows_the_config(section, values, for_pinned):
    from archway.config import config_from_dict
    config = config_from_dict({section: values, "kubernetes": {"enabled": "off"}})
    assert Policy.from_config(config).scheduler_for_pinned is for_pinned


# --- table: idempotence and shape errors ------------------------------------------------------

@pytest.mark.parametrize("pod", [
    make_pod("reg/multi:1"),
    make_pod("reg/arm:1"),
    make_pod("reg/amdarm:1", affinity=required(term(expr("z", "In", "a")), term(expr("d", "In", "b")))),
    make_pod("reg/arm:1", affinity=required(term(expr("z", "In", "a")))),
    make_pod("reg/multi:1", scheduler="default-scheduler"),
])
def test_reinvocation_changes_nothing(pod):
    policy = Policy(scheduler_name="archway")
    first = decide(pod, RESULTS, policy)
    assert first.patch
    second = decide(applied(pod, first), RESULTS, policy)
    assert second.patch == () and second.allowed and second.outcome == "unchanged"


@pytest.mark.parametrize("spec, message", [
    ({"containers": "nginx"}, "spec.containers must be a list"),
    ({"containers": ["nginx"]}, "spec.containers[0] must be a mapping"),
    ({"containers": [{"name": "a", "image": 7}]}, "spec.containers[0].image must be a string"),
    ({"containers": [{"name": "a", "image": "x"}], "nodeSelector": ["a"]},
     "spec.nodeSelector must be a mapping"),
    ({"containers": [{"name": "a", "image": "x"}], "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": {}}}}},
     "must be a list"),
])
def test_malformed_pods_raise_a_typed_error(spec, message):
    with pytest.raises(PodShapeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decide({"spec": spec}, {"x": AMD}, Policy())


def test_decide_does_not_modify_its_input():
    pod = make_pod("reg/arm:1", affinity=required(term(expr("z", "In", "a"))))
    before = copy.deepcopy(pod)
    decide(pod, RESULTS, Policy(scheduler_name="s"))
    assert pod == before


# --- properties -----------------------------------------------------------------------------

ARCH_VALUES = sorted(ALL_ARCHS)
arch_sets = st.frozensets(st.sampled_from(ARCH_VALUES), min_size=1, max_size=4)
keys = st.sampled_from([ARCH_LABEL, ARCH_LABEL, "beta.kubernetes.io/arch",
                        "topology.kubernetes.io/zone", "disktype"])


@st.composite
def expressions(draw):
    key = draw(keys)
    operator = draw(st.sampled_from(["In", "In", "NotIn", "Exists", "DoesNotExist"]))
    if operator in ("In", "NotIn"):
        pool = ARCH_VALUES if "arch" in key else ["a", "b", "ssd"]
        return expr(key, operator, *draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3,
                                                   unique=True)))
    return expr(key, operator)


@st.composite
def node_terms(draw):
    exprs = draw(st.lists(expressions(), max_size=3))
    fields = draw(st.lists(st.just({"key": "metadata.name", "operator": "In",
                                    "values": ["node-1"]}), max_size=1))
    return term(*exprs, fields=fields)


@st.composite
def pods(draw):
    n_images = draw(st.integers(1, 3))
    images = [f"reg/img{i}:1" for i in range(n_images)]
    selector = draw(st.one_of(st.none(), st.dictionaries(
        st.sampled_from([ARCH_LABEL, "disktype"]), st.sampled_from(ARCH_VALUES), max_size=2)))
    affinity = None
    if draw(st.booleans()):
        node_affinity = {}
        if draw(st.booleans()):
            node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
                "nodeSelectorTerms": draw(st.lists(node_terms(), min_size=1, max_size=3))}
        if draw(st.booleans()):
            node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
                {"weight": 1, "preference": term(expr("disktype", "In", "ssd"))}]
        affinity = {"nodeAffinity": node_affinity}
    scheduler = draw(st.sampled_from([None, "default-scheduler", "other"]))
    pod = make_pod(*images[1:], init=images[:1], node_selector=selector, affinity=affinity,
                   scheduler=scheduler)
    if n_images == 1:
        pod = make_pod(*images, node_selector=selector, affinity=affinity, scheduler=scheduler)
    results = {}
    for image in images:
        kind = draw(st.sampled_from(["archs", "archs", "archs", "unknown", "error"]))
        if kind == "archs":
            results[image] = ImageInfo(image, frozenset(normalize("linux", a) for a in
                                                        draw(arch_sets)), None, "oci-index")
        elif kind == "unknown":
            results[image] = ImageInfo(image, frozenset(), None, "sif-https")
        else:
            results[image] = DeadlineExceeded("slow")
    policy = Policy(fail_closed=draw(st.booleans()), deny_on_conflict=draw(st.booleans()),
                    deny_on_empty=draw(st.booleans()),
                    scheduler_name=draw(st.sampled_from([None, "archway"])))
    return pod, results, policy


def _required_terms_or_none(pod):
    return (pod["spec"].get("affinity", {}).get("nodeAffinity", {})
            .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms"))


PROPERTY_SETTINGS = settings(max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(pods())
def test_property_terms_are_narrowed_never_added(case):
    pod, results, policy = case
    d = decide(pod, results, policy)
    if not d.allowed:
        assert d.patch == () and d.message
        return
    out = applied(pod, d)
    assert out == jsonpatch.apply_patch(pod, jsonpatch.JsonPatch(list(d.patch)).patch)
    before, after = _required_terms_or_none(pod), _required_terms_or_none(out)
    if before is None:
        assert after is None or len(after) == 1
        return
    assert len(after) == len(before), "never a new ORed term"
    for old, new in zip(before, after):
        assert new.get("matchFields") == old.get("matchFields")
        old_exprs, new_exprs = old.get("matchExpressions", []), new.get("matchExpressions", [])
        assert new_exprs[:len(old_exprs)] == old_exprs, "existing expressions are kept, in order"
        added = new_exprs[len(old_exprs):]
        assert len(added) <= 1
        if added:
            assert added[0] == {"key": ARCH_LABEL, "operator": "In",
                                "values": sorted(d.architectures)}


@PROPERTY_SETTINGS
@given(pods())
def test_property_unconstrained_pods_end_up_within_s(case):
    pod, results, policy = case
    d = decide(pod, results, policy)
    assume(d.allowed and d.architectures and pod_arch_constraint(pod) is None)
    assume(any(t for t in (_required_terms_or_none(pod) or [{"x": 1}])))
    after = pod_arch_constraint(applied(pod, d))
    assert after is not None and not after.exceeds(d.architectures)
    # every term got the arch requirement: no term lets the pod onto another arch
    for t in _required_terms_or_none(applied(pod, d)) or []:
        if t:
            assert any(e.get("key") == ARCH_LABEL for e in t.get("matchExpressions", []))


@PROPERTY_SETTINGS
@given(pods())
def test_property_idempotent(case):
    pod, results, policy = case
    d = decide(pod, results, policy)
    assume(d.allowed)
    again = decide(applied(pod, d), results, policy)
    assert again.allowed and again.patch == ()
    assert again.architectures == d.architectures


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods())
def test_property_patched_pod_is_a_valid_pod(case):
    pod, results, policy = case
    d = decide(pod, results, policy)
    assume(d.allowed)
    validate(applied(pod, d))
    capped = cap_warnings(d.warnings)
    assert all(len(w) <= MAX_WARNING_CHARS for w in capped)
    assert len(capped) <= MAX_WARNINGS


def test_passwords_in_sif_urls_never_reach_warnings_or_messages():
    secret_url = "https://reader:s3cret@files.example/img/app.sif"
    d = decide(make_pod(secret_url), {secret_url: NotFound("x", host="files.example")}, Policy())
    assert "s3cret" not in d.warnings[0] and "https://***@files.example/img/app.sif" in d.warnings[0]
    denied = decide(make_pod(secret_url), {secret_url: NotFound("x")}, Policy(fail_closed=True))
    assert "s3cret" not in denied.message
    clash = decide(make_pod(secret_url, "reg/arm:1"),
                   {**RESULTS, secret_url: info(secret_url, "linux/amd64", source="sif-https")},
                   Policy())
    assert "s3cret" not in clash.message and "***@files.example" in clash.message


# --- policy: preferred architectures, tolerations, audit, the cluster's nodes --------------------

PREFER = (("arm64", 80), ("amd64", 20), ("s390x", 5))
ARM_TAINT = {"key": "kubernetes.io/arch", "operator": "Equal", "value": "arm64",
             "effect": "NoSchedule"}
TOLERATE = (("arm64", (ARM_TAINT,)), ("s390x", ({"key": "s390x", "operator": "Exists"},)))


def preferred_of(pod):
    return (pod["spec"].get("affinity", {}).get("nodeAffinity", {})
            .get("preferredDuringSchedulingIgnoredDuringExecution"))


def test_preferred_weights_for_the_archs_the_pod_can_run_on():
    pod = make_pod("reg/amdarm:1")
    out = applied(pod, decide(pod, RESULTS, Policy(preferred=PREFER)))
    assert preferred_of(out) == [
        {"weight": 80, "preference": {"matchExpressions": [
            {"key": ARCH_LABEL, "operator": "In", "values": ["arm64"]}]}},
        {"weight": 20, "preference": {"matchExpressions": [
            {"key": ARCH_LABEL, "operator": "In", "values": ["amd64"]}]}}]   # no s390x term
    assert terms_of(out)[0]["matchExpressions"][0]["values"] == ["amd64", "arm64"]
    validate(out)


def test_preferred_weights_respect_the_pods_own_constraint_and_preference():
    narrowed = make_pod("reg/multi:1", affinity=required(term(expr(ARCH_LABEL, "In", "amd64",
                                                                   "arm64"))))
    out = applied(narrowed, decide(narrowed, RESULTS, Policy(preferred=PREFER)))
    assert [t["weight"] for t in preferred_of(out)] == [80, 20]
    validate(out)
    own = {"weight": 1, "preference": {"matchExpressions": [
        {"key": ARCH_LABEL, "operator": "In", "values": ["amd64"]}]}}
    pod = make_pod("reg/multi:1", affinity={"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [own]}})
    assert preferred_of(applied(pod, decide(pod, RESULTS, Policy(preferred=PREFER)))) == [own]
    single = make_pod("reg/arm:1")   # pinned to arm64 already: a preference adds nothing
    assert preferred_of(applied(single, decide(single, RESULTS, Policy(preferred=PREFER)))) is None


def test_equal_preferred_weights_share_one_term_or_none():
    """Karpenter takes a pod's heaviest preferred term as a requirement: with one term per arch
    of equal weight it launched the first listed (amd64) instead of the cheaper arm64."""
    pod = make_pod("reg/multi:1")          # amd64, arm64, arm
    out = applied(pod, decide(pod, RESULTS, Policy(preferred=(("amd64", 50), ("arm64", 50)))))
    assert preferred_of(out) == [{"weight": 50, "preference": {"matchExpressions": [
        {"key": ARCH_LABEL, "operator": "In", "values": ["amd64", "arm64"]}]}}]   # not arm
    validate(out)
    two = make_pod("reg/amdarm:1")         # amd64, arm64: equal weights prefer nothing
    out = applied(two, decide(two, RESULTS, Policy(preferred=(("amd64", 50), ("arm64", 50)))))
    assert preferred_of(out) is None
    out = applied(two, decide(two, RESULTS, Policy(preferred=(("arm64", 50),))))
    assert [t["preference"]["matchExpressions"][0]["values"] for t in preferred_of(out)] == [["arm64"]]


def test_preferred_terms_join_other_preferences_of_the_pod():
    zone = {"weight": 50, "preference": {"matchExpressions": [
        {"key": "zone", "operator": "In", "values": ["a"]}]}}
    pod = make_pod("reg/amdarm:1", affinity={"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [zone]}})
    out = applied(pod, decide(pod, RESULTS, Policy(preferred=PREFER)))
    assert [t["weight"] for t in preferred_of(out)] == [50, 80, 20]
    validate(out)


def test_tolerations_added_for_the_archs_the_pod_may_run_on_never_twice():
    pod = make_pod("reg/multi:1")
    out = applied(pod, decide(pod, RESULTS, Policy(tolerations=TOLERATE)))
    assert out["spec"]["tolerations"] == [ARM_TAINT]   # s390x is not one of the images' archs
    validate(out)
    pod["spec"]["tolerations"] = [{"key": "kubernetes.io/arch", "value": "arm64",
                                   "effect": "NoSchedule"}]          # operator "" means Equal
    d = decide(pod, RESULTS, Policy(tolerations=TOLERATE))
    assert applied(pod, d)["spec"]["tolerations"] == pod["spec"]["tolerations"]
    amd = make_pod("reg/amd:1")
    assert "tolerations" not in applied(amd, decide(amd, RESULTS, Policy(tolerations=TOLERATE)))[
        "spec"]


class Node:
    def __init__(self, arch, *taints, os="linux"):
        self.arch, self.taints, self.os = arch, tuple(taints), os


CORDON = ("node.kubernetes.io/unschedulable", "", "NoSchedule")


def test_pod_no_node_can_run_is_warned_about_or_denied():
    nodes = [Node("amd64"), Node("arm64")]
    s390x = info("reg/z:1", "linux/s390x")
    pod = make_pod("reg/z:1")
    d = decide(pod, {"reg/z:1": s390x}, Policy(), nodes=nodes)
    assert d.allowed and d.unschedulable == "images are s390x-only; nodes: amd64, arm64"
    assert d.warnings[0] == "images are s390x-only; nodes: amd64, arm64; the pod would stay Pending"
    denied = decide(pod, {"reg/z:1": s390x}, Policy(deny_unschedulable=True), nodes=nodes)
    assert not denied.allowed and "s390x-only" in denied.message and denied.unschedulable
    fine = decide(make_pod("reg/amdarm:1"), RESULTS, Policy(deny_unschedulable=True), nodes=nodes)
    assert fine.allowed and not fine.unschedulable and not fine.warnings
    # An empty node cache says nothing about the cluster.
    assert not decide(pod, {"reg/z:1": s390x}, Policy(), nodes=[]).unschedulable


def test_nodes_tainted_against_the_pod_do_not_count():
    tainted_arm = [Node("amd64"), Node("arm64", ("kubernetes.io/arch", "arm64", "NoSchedule"))]
    pod = make_pod("reg/arm:1")
    d = decide(pod, RESULTS, Policy(), nodes=tainted_arm)
    assert d.unschedulable == "images are arm64-only; nodes: amd64"
    # ... unless archway's own toleration lets the pod onto them
    tolerated = decide(pod, RESULTS, Policy(tolerations=TOLERATE), nodes=tainted_arm)
    assert not tolerated.unschedulable
    # a cordoned node never counts; PreferNoSchedule only discourages
    assert decide(pod, RESULTS, Policy(), nodes=[Node("arm64", CORDON)]).unschedulable == (
        "images are arm64-only; nodes: none the pod tolerates")
    assert not decide(pod, RESULTS, Policy(),
                      nodes=[Node("arm64", ("x", "", "PreferNoSchedule"))]).unschedulable
    pod["spec"]["tolerations"] = [{"operator": "Exists"}]
    assert not decide(pod, RESULTS, Policy(), nodes=[Node("arm64", CORDON)]).unschedulable


@pytest.mark.parametrize("pod, results, would", [
    (make_pod("reg/amdarm:1"), RESULTS, "mutated"),
    (make_pod("reg/amd:1", "reg/arm:1"), RESULTS, "denied"),
    (make_pod("reg/gone:1"), {}, "fail_open"),
])
def test_audit_mode_changes_no_placement_and_says_what_enforce_would_do(pod, results, would):
    d = decide(pod, results, Policy(mode="audit", preferred=PREFER, tolerations=TOLERATE,
                                    scheduler_name="archway"))
    assert d.allowed and d.outcome == "audited" and d.would == would
    assert d.warnings[0].startswith("audit mode: archway would have")
    out = applied(pod, d)
    assert out["spec"] == pod["spec"]
    if would != "fail_open":
        assert ANNOTATION_IMAGES in out["metadata"]["annotations"]
    validate(out)


def test_images_annotation_is_bounded_and_marks_what_it_left_out():
    images = [f"reg/many-{i:03d}:{'x' * 100}" for i in range(100)]
    results = {im: info(im, "linux/amd64") for im in images}
    text = patches.images_annotation(images, results)
    entries = json.loads(text)
    assert len(text) <= patches.MAX_IMAGES_ANNOTATION_CHARS
    assert entries[-1] == {"truncated": 100 - (len(entries) - 1)}
    assert [e["image"] for e in entries[:-1]] == images[:len(entries) - 1]
    (gone,) = json.loads(patches.images_annotation(["reg/gone:1"], {}))
    assert set(gone) == {"image", "error"} and gone["error"]


# --- the patch ------------------------------------------------------------------------------------

_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["a", "b", "k/s", "t~0", ""]), children, max_size=3), max_leaves=8)
_JSON_MAPS = st.dictionaries(st.sampled_from(["a", "b", "k/s", "t~0", ""]), _JSON_VALUES,
                             max_size=4)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(old=_JSON_MAPS, new=_JSON_MAPS)
def test_json_patch_turns_the_old_document_into_the_new_one(old, new):
    patch = json_patch(old, new)
    assert jsonpatch.apply_patch(copy.deepcopy(old), list(patch)) == new
    assert (patch == ()) == (json.dumps(old, sort_keys=True) == json.dumps(new, sort_keys=True))


def test_json_patch_tells_true_from_1_inside_maps_and_lists():
    assert json_patch({"a": {"b": True}, "c": [1]}, {"a": {"b": 1}, "c": [True]}) == (
        {"op": "replace", "path": "/a/b", "value": 1},
        {"op": "replace", "path": "/c/0", "value": True})


def test_json_patch_appends_to_lists_item_by_item():
    old = {"terms": [{"matchExpressions": [{"key": "zone"}]}, {"matchExpressions": []}]}
    new = {"terms": [{"matchExpressions": [{"key": "zone"}, {"key": "arch"}]},
                     {"matchExpressions": [{"key": "arch"}]}]}
    assert json_patch(old, new) == (
        {"op": "add", "path": "/terms/0/matchExpressions/1", "value": {"key": "arch"}},
        {"op": "add", "path": "/terms/1/matchExpressions/0", "value": {"key": "arch"}})


def test_json_patch_escapes_keys_and_adds_missing_maps_whole():
    old = {"metadata": {}, "spec": {"nodeSelector": {"a/b": "x"}}}
    new = {"metadata": {"annotations": {"archway.dev/architectures": "amd64"}},
           "spec": {"nodeSelector": {"a/b": "x", "kubernetes.io/arch": "amd64"}}}
    assert json_patch(old, new) == (
        {"op": "add", "path": "/metadata/annotations",
         "value": {"archway.dev/architectures": "amd64"}},
        {"op": "add", "path": "/spec/nodeSelector/kubernetes.io~1arch", "value": "amd64"})


def test_a_host_refused_by_policy_says_the_rule_and_the_key_once():
    """Issue 47: a host archway chose not to contact is not "unreachable": each image's warning
    names the rule, one line per rule names the key that allows it; both fit the API's 120
    characters, and neither carries the error's own message (the address it resolved to)."""
    from archway.errors import POLICY_RULES
    from archway.webhook.admission import MAX_WARNING_CHARS
    pod = make_pod("127.0.0.1:9/team/app:1.0", "127.0.0.1:9/team/sidecar:1.0", "reg/down:1")
    results = {"127.0.0.1:9/team/app:1.0": HostRefused("at 127.0.0.1 secret", rule="loopback"),
               "127.0.0.1:9/team/sidecar:1.0": HostRefused("at 127.0.0.1", rule="loopback"),
               "reg/down:1": TransportError("refused", host="reg")}
    d = decide(pod, results, Policy())
    assert d.warnings == (
        "could not inspect 127.0.0.1:9/team/app:1.0 (refused by policy: loopback); it "
        "does not restrict placement",
        "could not inspect 127.0.0.1:9/team/sidecar:1.0 (refused by policy: loopback); "
        "it does not restrict placement",
        "could not inspect reg/down:1 (registry unreachable); it does not restrict placement",
        "archway contacts a loopback address only when registry.allow_hosts lists its host")
    assert all(len(w) <= MAX_WARNING_CHARS for w in d.warnings)
    for rule, (_, hint) in POLICY_RULES.items():
        d = decide(make_pod("127.0.0.1:9/team/app:1.0"),
                   {"127.0.0.1:9/team/app:1.0": HostRefused("secret", rule=rule)}, Policy())
        assert all(len(w) <= MAX_WARNING_CHARS and "secret" not in w for w in d.warnings), rule
        assert d.warnings[1:] == ((hint,) if hint else ()), rule
