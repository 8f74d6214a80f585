"""GPU timing, GPU identity, baselines and the regression verdict behind ``nox -s perf``."""
