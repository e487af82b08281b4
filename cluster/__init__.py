"""The cluster as archway reads it: list + watch caches of Nodes, Namespaces, the workloads and
Karpenter's NodePools, a pod's pull secrets and its ServiceAccount's, what it pulls with as its
own workload identity (token-mode credential providers), the cluster's own
addresses, the reads `explain` and `report` make, and the Events archway writes for a human.
Every read bounded in time and size, through the process's one Kubernetes client.

  2  caches           the caches a process reads, built from the config in one place
  1  nodepools        the architectures Karpenter's NodePools may launch, as nodes
  2  pullsecrets      a pod's registry credentials, from its pull secrets and ServiceAccount
  1  workloadidentity  credentials of token-mode providers, run with the pod's ServiceAccount token
  1  workloadcache    who controls whom, what each workload learned, its pod templates
  0  apireads         one bounded API call for a pod's credentials, its failure in words
  0  events           Events (events.k8s.io/v1) about a pod or its owner
  0  nodes            a Node's architecture, OS, addresses and taints, and their cache
  1  ranges           the Service ranges, API server and Nodes a pod's image may not name
  0  reads            reads of the cluster for the tools and pre-warming, paged and bounded
  0  serviceaccounts  which pull secrets each ServiceAccount names, watched
  0  workloads        pod templates of every workload kind, from manifests or the cluster (pure)

Its face, what other rooms may use (tests/test_rooms.py holds them to it):

  caches           ClusterCaches
  events           EventSink, REASON_UNSCHEDULABLE, REPORTING_CONTROLLER, owner_reference, pod_or_owner, pod_reference
  nodes            NodeCache, NodeFacts, node_facts
  pullsecrets      PullCredentials, PullSecrets
  ranges           ClusterRanges, keep_cluster_ranges
  reads            ClusterReader
  workloadcache    WorkloadCache, WorkloadFacts, controlling_workload, pod_owner, top_workload, workload_facts, workload_path, workload_reference
  workloads        TEMPLATE_PATHS, Wanted, Workload, controller_of, is_top_level, wanted_images, workloads_in
"""
