"""The mutating admission webhook: POST /mutate reads a pod's images and places it on nodes of
an architecture they all support.

  routes          POST /mutate, declared once: the body handed to the service, its answer out
  service         the admission service: parse, skip, resolve, decide, reply (no HTTP)
  debugservice    kubectl debug: an ephemeral container's image checked against its node
  admission       AdmissionReview in and out (pure)
  interfaces      what the service asks of the world, as small interfaces
  wiring          the webhook's parts in a worker, built once
  prewarm         the images the cluster already runs, read as a worker starts
  admissionreview `archway admission-review`: a review to curl

The decision itself is the placement model's (placement/), what it reads of the cluster
cluster/'s, archway's own objects objects/'s.
"""
