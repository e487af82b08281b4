"""The one-machine lab: a real Kubernetes control plane built from source with archway installed
by its Helm chart (`scripts/cluster.sh`, docs/real-control-plane.md's "Try it on one machine"), Nodes simulated by
KWOK or launched by Karpenter, one real node, VM nodes of other architectures, and the real and stand-in servers archway is tried
against (a registry, Prometheus, an API server, hostile peers). tests/, bench/ and scripts/
import it; it imports none of them, nor pytest, and it is not in archway's wheel.

Its rooms stand on floors: each imports only from its own room and the floors below, never up
(tests/test_rooms.py checks this table against the imports).

  3  __main__  the command line: python -m lab up|down|status (behind scripts/cluster.sh)
  2  cluster   the control plane and what joins it: controlplane (pki, processes), kwok,
               karpenter, realnode (nodehost, nodeimages), vmnode (vmimage: a VM node of
               another architecture under qemu-system), chart (archway's Helm install as
               the tests and `up` run it), incluster (the install on the real node),
               tokenplugin (a token-mode credential provider that checks with a TokenReview)
  1  servers   servers on loopback: registry (tokenserver, jws), apiserver (apiobjects,
               kubevalidation), prometheus, fileserver, proxy, faults, stalled
  0  ground    what every room shares: procs (processes, ports, waiting), tls (a test CA),
               httpd (a threaded HTTP(S) server), kube (an API client), clock
"""
