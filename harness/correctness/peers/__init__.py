"""Other implementations measured beside ours in the perf session (see tests/perf)."""
