"""The server: HTTP for archway's products, which it knows nothing of.

    routes      the route table products declare their routes in: Request, Reply, Route,
                Site; the JSON refusals; a route asked on the loop first, then on a thread
    http1       HTTP/1.1 on one connection without I/O: httptools' llhttp under archway's
                limits (target, head, version, Expect, body), the answer's bytes
    loop        the connection loop of a worker: accept, TLS (and plain HTTP on the TLS port
                told so), deadlines, connection and byte budgets, answers on the loop or from
                handler threads, written as the client takes them
    linger      closing a connection after its last answer without blocking the loop
    listeners   a listening socket of each worker's own (SO_REUSEPORT)
    worker      gunicorn's worker class on its documented seam (gunicorn.workers.base.Worker)
    master      gunicorn's settings and its Application (gunicorn.app.base.BaseApplication)
    supervisor  the processes `archway serve` keeps running beside gunicorn's master (the gate
                controller, the traffic poller), and their health as the workers read it

It stands on the ground (and certs/, for TLS); products import its route table, only the top
(archway.main) runs it, and the top decides what runs in it: the site each worker serves, the
processes beside it.
"""
