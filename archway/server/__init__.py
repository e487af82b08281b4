"""The server seam: archway's gunicorn adapter, which knows nothing of the products it serves.

    master      gunicorn's settings (gunicorn_options), its arbiter that also keeps the child
                processes running, and the application that loads the app the top hands it
    worker      the gthread worker: handshakes and request heads read in the main loop under
                deadlines, the request's arrival handed to the app in its WSGI environ
    linger      closing a connection after its last answer without blocking the main loop
    listeners   a listening socket of each worker's own (SO_REUSEPORT)
    supervisor  a child process of the master (the gate controller, the traffic poller) kept
                running, and its health as the workers read it

It stands on the core (and certs/, for TLS); only the top (archway.serve, archway.app) imports
it, and the top decides what runs in it: the app each worker loads, the child processes.
"""
