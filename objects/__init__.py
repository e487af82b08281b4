"""archway's own Kubernetes objects (archway.dev/v1alpha1): PlacementPolicy and
ClusterPlacementPolicy, and the image records. Here is where a kind's objects are read (the few
facts archway uses of each, and why it cannot apply one the apiserver accepted), cached, written
and given their status; their schemas are the chart's CRDs (charts/archway/templates/crds/), and
what the placement model makes of a policy is placement/policies.py's.

  2  imagerecords     the records as the resolver's store: listed, watched, offered, written
  1  policystatus     the leader's status of each policy: Ready, Invalid, Conflicting
  1  recordwriter     the records' writes: off the admission's path, coalesced, bounded
  0  policies         the policy kinds read, and their list + watch caches
  0  records          a record's object: its path, a record to an object and back

Its face, what other rooms may use (tests/test_rooms.py holds them to it):

  imagerecords     ImageRecords, read_records, records_for
  policystatus     PolicyStatus
  policies         CLUSTER_KIND, GROUP, NAMESPACED_KIND, PolicyCache, policy_object
  records          API_PATH, object_path, record_object
"""
