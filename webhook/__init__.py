"""The mutating admission webhook: POST /mutate reads a pod's images and places it on nodes of
an architecture they all support (admission, service, placement, pullsecrets, namespaces, app).

For now it also holds the gate (gate, gatecontroller, gatecli, lease, supervisor: pods gated on
a cache miss, released by one elected controller) and the operator tools (explain, report,
workloads, cluster), which move to rooms of their own (CONTRIBUTING.md)."""
