"""The benchmark of scripts/bench.py, by concern: the shared harness (harness,
client, measure, report), one module per row or family of rows, and the
registry of rows in `rows`."""
