"""archway benchmarks: `bash bench/run.sh` (see docs/benchmarks.md)."""
