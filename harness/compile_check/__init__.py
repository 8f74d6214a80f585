"""The CPU-side compile check: every variant built for every checked arch, its ptxas resources
compared with the recorded ones."""
