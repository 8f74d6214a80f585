"""Running a test's step in a thread of its own (a thread that has not used CUDA yet)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def in_fresh_thread(step: Callable[[], dict]) -> dict:
    """``step()``'s result, computed in a new thread; its exception is raised here."""
    seen: dict = {}

    def run():
        try:
            seen["result"] = step()
        except BaseException as exc:  # re-raised in the calling thread
            seen["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in seen:
        raise seen["error"]
    return seen["result"]
