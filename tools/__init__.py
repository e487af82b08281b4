"""The operator tools: `archway explain` (what archway would do with a workload, or did with a pod)
and `archway report` (every workload's architectures and where it could move)."""
