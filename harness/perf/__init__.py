"""The perf gate behind ``nox -s perf``: GPU timing (``gpu_timer``), GPU identity (``gpu_info``),
the case list (``catalog``), what counts as a regression (``policy``), paired statistics
(``stats``), verdicts and exit status (``gate``), stored baselines and the drift guard
(``baseline``), the sides of an A/B session (``sides``), the measuring process (``worker``),
the session that drives it (``session``) and the summary (``report``)."""
