"""The placement model: what archway decides for a pod, from facts others gathered. Pure: no
I/O, no clock, no Kubernetes client; the webhook, the gate controller, the extender's callers
and the operator's tools all decide through it, so they decide alike.

The modules stand on floors, each importing only from the floors below its own (and from
archway/'s ground floor and registry/'s model):

  2  debugcontainers  whether a debug container's image can run on its pod's node
  2  policies         the policy in force for a pod: placement policies, Namespace, config
  1  decision         decide: the images' architectures intersected, and how to pin the pod
  1  namespaces       a Namespace's label and annotation over the configured policy
  0  archset          the pod's own architecture constraint, as a (co-finite) set
  0  learning         what a workload learned from exec format errors, on its annotations
  0  patches          the changes a placement makes to a pod, and their JSON patch
  0  policy           the configured policy, and who opts out of it

Its face, what other rooms may use (tests/test_rooms.py holds them to it):

  debugcontainers  DebugDecision, DebugRequest, NodePlatform, decide_debug, read_debug_request
  decision         Decision, decide, display_image, gated_warnings, named
  policies         InForce, PolicyObject, PolicySettings, conflicts_of, namespace_labels, policy_in_force, unsupported
  namespaces       NamespaceFacts, namespace_facts, namespace_mode
  archset          ArchSet, pod_arch_constraint
  learning         Evidence, Learned, learned_from, merged_annotations, reset_reason, short_digest
  patches          gate_patch, require_no_node
  policy           MODES, Policy, UNRESOLVED, opt_out_reason
"""
