"""Kubernetes LabelSelector matching (archway/labelselector.py) and the pod webhooks' selectors
of a MutatingWebhookConfiguration (gate/coverage.py): pure functions."""
import pytest

from archway.gate.coverage import pod_webhooks, webhook_covers
from archway.labelselector import selector_matches

LABELS = {"team": "a", "tier": "web"}


@pytest.mark.parametrize("selector, matches", [
    (None, True),
    ({}, True),
    ({"matchLabels": {"team": "a"}}, True),
    ({"matchLabels": {"team": "b"}}, False),
    ({"matchLabels": {"team": "a", "zone": "x"}}, False),
    ({"matchExpressions": [{"key": "team", "operator": "In", "values": ["a", "b"]}]}, True),
    ({"matchExpressions": [{"key": "team", "operator": "In", "values": ["b"]}]}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["x"]}]}, False),
    ({"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["a"]}]}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["x"]}]}, True),
    ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, True),
    ({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}, True),
    ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, False),
    # matchLabels AND matchExpressions
    ({"matchLabels": {"team": "a"},
      "matchExpressions": [{"key": "tier", "operator": "In", "values": ["db"]}]}, False),
    # what archway cannot read matches nothing: the pod is left alone
    ({"matchExpressions": [{"key": "tier", "operator": "Gt", "values": ["1"]}]}, False),
    ("team=a", False),
    ({"matchExpressions": "team"}, False),
])
def test_selector_matches_as_kubernetes_does(selector, matches):
    assert selector_matches(selector, LABELS) is matches


def test_only_the_webhooks_taking_pod_creation_count_and_any_of_them_covers():
    pods = {"rules": [{"operations": ["CREATE"], "resources": ["pods"]}],
            "namespaceSelector": {"matchLabels": {"archway.dev/enabled": "true"}}}
    everything = {"rules": [{"operations": ["*"], "resources": ["*"]}],
                  "objectSelector": {"matchLabels": {"pick": "me"}}}
    other = {"rules": [{"operations": ["CREATE"], "resources": ["deployments"]}]}
    configuration = {"webhooks": [pods, other, everything, "junk"]}
    assert pod_webhooks(configuration) == [pods, everything]
    assert webhook_covers([pods, everything], {"archway.dev/enabled": "true"}, {})
    assert webhook_covers([pods, everything], {}, {"pick": "me"})
    assert not webhook_covers([pods, everything], {}, {})
    assert not webhook_covers([], {}, {}), "no pod webhook: archway is sent no pod"
