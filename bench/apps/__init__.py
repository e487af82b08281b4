"""The bench's own apps, each run as a process of its own (`python3 -m bench.apps.NAME`): the
baselines and instrumented servers the sections measure beside archway. They import archway,
never the rest of the bench."""
