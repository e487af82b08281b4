"""The mutating admission webhook: POST /mutate reads a pod's images and places it on nodes of
an architecture they all support.

admission (AdmissionReview in and out, pure) -> service (parse, skip, resolve, decide, reply; no
HTTP) -> placement (the decision, pure: policy, archset, patches) ; app (the HTTP side);
pullsecrets, namespaces, workloadcache and learning (what the decision reads of the cluster);
events, prewarm."""
