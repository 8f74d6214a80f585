"""How many calls each seam sent to our kernels or back to bitsandbytes: ``patch.routed_calls`` reads
them; the patched seams and the registered ops count."""

from __future__ import annotations

from collections import Counter

counts: Counter = Counter()  # (seam label, "ours" | "fallback") -> calls


def count(label: str, ours: bool) -> None:
    counts[label, "ours" if ours else "fallback"] += 1
