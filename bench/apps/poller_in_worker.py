"""Figure 7's baseline: `archway serve` as it was before the traffic poller got a process of its
own (issue 28): the workers elect a poller among themselves, which queries Prometheus and parses
its answer in a thread of a process that answers prioritize. Same arguments as archway.main.cli; the
difference is archway.main.serve.serve's own `poller_process=False`.

    python3 -m bench.apps.poller_in_worker --config FILE serve --bind 127.0.0.1:PORT
"""
import sys

from archway.main.cli import main

if __name__ == "__main__":
    sys.exit(main(poller_process=False))
