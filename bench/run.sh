#!/usr/bin/env bash
# archway's benchmarks, side by side, in one run: prints one table of figures with their targets
# (PASS/MISS) and writes it with the machine's description to bench/results/latest.md.
#   bash bench/run.sh                     everything (a few minutes on 2 cores)
#   bash bench/run.sh --only admission    some sections (bench/sections/): policy, ranges, registry, cache, drip, dns, uncached, admission, slowclients, memory, gate, bodies, extender, burst, records, events, kube, loop, scale, autoscale, realnode (root), vmnode (root, qemu)
#   BENCH_SKIP_SETUP=1 bash bench/run.sh  skip the (idempotent) install step
#   bash bench/run.sh --rounds 7 --noise-bound 0.1   interleaved rounds per ratio figure (BENCH_ROUNDS,
#                                         default 5) and the spread past which it is NOISY (BENCH_NOISE_BOUND)
#   BENCH_PIN=0 bash bench/run.sh --only extender   figures 7, 8b (and 1d) without the measured server on a
#                                         CPU of its own (bench/common/pinning.py; default: pinned on 2+ CPUs)
# SVG plots go to bench/results/plots/ when matplotlib is installed (bench/requirements.txt).
# Profiling a missed target needs py-spy: pip install -r bench/requirements.txt, then
#   python3 -m bench.profile admission
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${BENCH_SKIP_SETUP:-}" != 1 ]; then
  # The real servers the benchmarks start (docker-registry, prometheus, wrk...) and what the
  # lab (lab/: the control plane, KWOK, the chart's install) needs.
  bash scripts/setup.sh --test
fi
. scripts/venv.sh
export PATH="$ARCHWAY_VENV/bin:$PATH"
exec "$ARCHWAY_VENV/bin/python" -m bench "$@"
