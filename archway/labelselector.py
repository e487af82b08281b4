"""Kubernetes LabelSelector matching (metav1.LabelSelector), as the apiserver applies a webhook's
namespaceSelector and objectSelector: every matchLabels pair AND every matchExpressions
requirement holds. An empty or absent selector matches everything; a selector archway cannot
read (not a map, an unknown operator) matches nothing, which leaves the pod alone."""


def selector_matches(selector: object, labels: dict) -> bool:
    if selector is None:
        return True
    if not isinstance(selector, dict):
        return False
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not isinstance(match_labels, dict) or not isinstance(expressions, list):
        return False
    return all(labels.get(key) == value for key, value in match_labels.items()) \
        and all(requirement_holds(expression, labels) for expression in expressions)


def requirement_holds(expression: object, labels: dict) -> bool:
    """One matchExpressions entry: In, NotIn, Exists, DoesNotExist."""
    if not isinstance(expression, dict):
        return False
    key, operator = expression.get("key"), expression.get("operator")
    values = expression.get("values") or []
    if not isinstance(values, list):
        return False
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    return False
