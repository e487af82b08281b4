"""The operator tools: `archway explain` (what archway would do with a workload, or did with a
pod: explain, explanation, manifests, livepod, explainpolicy), `archway report` (every
workload's architectures and where it could move) and `archway cleanup`; kubeargs: their
`--kubeconfig` and `--context`."""
