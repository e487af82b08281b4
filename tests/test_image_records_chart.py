"""The chart's part of the image records (docs/image-records.md): the two CRDs behind
crds.install, kept on uninstall, with their columns; the RBAC behind
config.kubernetes.image_records.enabled; its keys accepted by the values schema."""
import yaml

from tests.test_chart import CHART, helm, helm_env

RELEASE = "rec"


def rendered(helm_env, *args) -> list[dict]:
    out = helm(helm_env, "template", RELEASE, CHART, "-n", "archway", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_the_crds_are_rendered_kept_and_show_image_architectures_digest_age(helm_env):
    crds = {d["spec"]["names"]["kind"]: d for d in rendered(helm_env)
            if d["kind"] == "CustomResourceDefinition" and d["spec"]["group"] == "archway.dev"}
    assert set(crds) >= {"ClusterImageRecord", "ImageRecord"}
    for kind, scope in (("ClusterImageRecord", "Cluster"), ("ImageRecord", "Namespaced")):
        crd = crds[kind]
        assert crd["spec"]["scope"] == scope
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert "archway" in crd["spec"]["names"]["categories"] and crd["spec"]["names"]["shortNames"]
        (version,) = crd["spec"]["versions"]
        assert version["name"] == "v1alpha1" and "subresources" not in version   # all spec
        shown = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
        assert shown == ["Image", "Architectures", "Digest", "Age"]
    off = rendered(helm_env, "--set", "crds.install=false")
    assert not [d for d in off if d["kind"] == "CustomResourceDefinition"
                and d["spec"]["group"] == "archway.dev" and "ImageRecord" in d["spec"]["names"]["kind"]]


def test_the_records_rbac_follows_the_config_and_grants_no_patch(helm_env):
    def roles(*args):
        return [d for d in rendered(helm_env, *args)
                if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-image-records")]
    (role,) = roles()
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["archway.dev"]
    assert set(rule["resources"]) == {"clusterimagerecords", "imagerecords"}
    assert set(rule["verbs"]) == {"get", "list", "watch", "create", "update", "delete"}
    assert roles("--set", "config.kubernetes.image_records.enabled=false") == []
    assert roles("--set", "rbac.create=false") == []
    # Every key of the section passes the values schema.
    rendered(helm_env, "--set", "config.kubernetes.image_records.expire_seconds=3600",
             "--set", "config.kubernetes.image_records.max_queued_writes=10",
             "--set", "config.kubernetes.image_records.start_wait_seconds=0")
