"""The top: archway's programs, put together from the rooms below, which nothing imports.

    cli         the `archway` command: every subcommand's module registers its parser
    kubectl     `kubectl-archway`, the kubectl plugin: inspect, explain, report as kubectl finds the cluster
    completion  `archway completion bash|zsh`, made from that parser
    serve       `archway serve`: config, TLS, preflight, the processes kept running beside
                gunicorn's master, then archway.server
    addresses   one server per address: an address already served is refused, named
    worker      one serving worker, its parts as typed fields (the composition root)
    probes      /healthz, /readyz and /metrics of a worker
"""
