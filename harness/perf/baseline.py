"""Stored baselines: the long-range drift guard, one file per GPU model.

The A/B gate compares a pull request with its base, so it cannot see a slowdown that arrives a
little at a time, each step under the threshold. The stored baseline can: every gate run also
compares the candidate's absolute time with the pinned value for its GPU model, with a tolerance
derived from how much that value moved between the sessions (machines) it was recorded from.

``baselines/<gpu-slug>.json``:

    {"schema": 2, "gpu": {...}, "sessions": N, "timer_floor_us": F,
     "cases": {case: {"us": ..., "spread": ..., "numel": ..., "gpus": G}}}

``us`` is the median over sessions of each session's median GPU time, rounded to three
significant digits; ``spread`` the largest relative distance of a session from it, rounded up to
0.1%; ``gpus`` how many GPUs (by NVML UUID) those sessions ran on (absent in entries recorded
before it was kept). Sessions on one GPU measure that GPU, not its model: the spread of an entry
from one GPU says nothing of how far other GPUs of the model sit from it (one H100's entry read 11%
slow on three others; kernels/NOTES.md, "The H100 baseline's gate weight at 16 rows"), so the drift
check names the drifted entries that stand on one GPU and the command line warns when it writes
one. Re-recording keeps an entry whose value moved by less than the case's threshold (and whose
spread did not grow, and which stood on no fewer GPUs), so re-recording unchanged code rewrites
no line.

``timer_floor_us`` is what the sessions' timer read for a launch of nothing
(``gpu_timer.empty_interval_us``). Every timed launch carries it, and it is a property of the host,
not of the GPU model: one H100 host read 1.25 µs, another 2.94, and every case there measured
1.3-2.3 µs slower (kernels/NOTES.md, "The drift guard across hosts"). So the check compares each
time with its entry moved by the difference between the session's floor and the file's, and
records from another host are moved onto the file's floor before they are merged. A file without
one (recorded before it was kept) is compared as measured.

A session writes a *record* (``session_record``); ``python -m harness.perf.baseline RECORD...``
combines records from several sessions, on several machines where available, into the file;
``--cases PATTERN`` merges only the cases a change moved, so the others keep their hosts.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.perf import policy
from harness.perf.stats import relative_spread

SCHEMA = 2
SAVE_COMMAND = "nox -s perf -- --save-baseline"
GPU_KEYS = ("name", "driver", "cuda_driver", "default_sm_clock_mhz", "max_sm_clock_mhz")


@dataclass(frozen=True)
class Entry:
    us: float
    spread: float
    numel: int
    gpus: int | None = None  # None: recorded before the count was kept

    def tolerance(self) -> float:
        return policy.drift_tolerance(policy.size_class(self.numel), self.spread)


@dataclass(frozen=True)
class Baseline:
    path: Path
    gpu: dict
    sessions: int
    cases: dict[str, Entry]
    timer_floor_us: float | None = None  # None: not recorded


def round_us(us: float) -> float:
    """Three significant digits: a re-recording that moved less than the threshold keeps the old
    value anyway, this only keeps the file readable."""
    if us <= 0:
        raise ValueError(f"a time must be positive, got {us}")
    return round(us, 2 - math.floor(math.log10(us)))


def round_spread(spread: float) -> float:
    """Up to the next 0.1%, so a rounded spread never understates what was measured."""
    return math.ceil(round(spread * 1000, 6)) / 1000


def _entries(data: dict) -> dict[str, Entry]:
    return {k: Entry(v["us"], v["spread"], v["numel"], v.get("gpus")) for k, v in data["cases"].items()}


def path_for(gpu: dict, directory: Path) -> Path:
    return directory / f"{gpu['slug']}.json"


def load(gpu: dict, directory: Path) -> tuple[Baseline | None, str]:
    """The baseline for this GPU model, or None with the one line that says why not."""
    if gpu.get("nvml") != "ok":
        return None, f"drift check: no GPU identity (NVML {gpu.get('nvml')}), so no baseline to compare with"
    path = path_for(gpu, directory)
    if not path.exists():
        return None, (
            f"drift check: not run, no stored baseline for {gpu['name']} ({path.name}); "
            f"record one with `{SAVE_COMMAND}` (the A/B gate above is complete without it)"
        )
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        return None, f"drift check: not run, {path.name} has schema {data.get('schema')}, expected {SCHEMA}; re-record"
    if data["gpu"].get("name") != gpu["name"]:
        return None, f"drift check: not run, {path.name} was recorded on {data['gpu'].get('name')!r}"
    cases = _entries(data)
    note = "; ".join(
        f"{k} was {data['gpu'].get(k)}, now {gpu.get(k)}" for k in GPU_KEYS[1:] if data["gpu"].get(k) != gpu.get(k)
    )
    line = f"drift check: against {path.name} ({data['sessions']} sessions)" + (f"; {note}" if note else "")
    return Baseline(path, data["gpu"], data["sessions"], cases, data.get("timer_floor_us")), line


def session_record(
    gpu: dict,
    software: dict,
    medians_us: Mapping[str, float],
    numels: Mapping[str, int],
    timer_floor_us: float | None = None,
) -> dict:
    """What one session contributes to a baseline: its per-case median GPU times and its timer's floor."""
    return {
        "schema": SCHEMA,
        "gpu": {k: gpu.get(k) for k in (*GPU_KEYS, "slug", "uuid")},
        "software": software,
        "timer_floor_us": timer_floor_us,
        "cases": {c: {"us": medians_us[c], "numel": numels[c]} for c in sorted(medians_us)},
    }


def floor_of(records: list[dict]) -> float | None:
    """The records' timer floor (the median of theirs), None where one has none."""
    floors = [r.get("timer_floor_us") for r in records]
    return None if not floors or None in floors else statistics.median(floors)


def combine(records: Iterable[dict], floor: float | None = None) -> tuple[dict, int, dict[str, Entry], float | None]:
    """(gpu, sessions, entries, their timer floor) from session records of one GPU model; a case
    must be in all. Where every record has a floor, each session's times are moved onto ``floor``
    (default: the records' own, ``floor_of``) first; else they are taken as measured (floor None)."""
    records = list(records)
    if not records:
        raise ValueError("no session records to combine")
    names = {r["gpu"]["name"] for r in records}
    if len(names) != 1:
        raise ValueError(f"records from different GPU models cannot be combined: {sorted(names)}")
    common = set.intersection(*(set(r["cases"]) for r in records))
    if (own := floor_of(records)) is None:
        floor = None  # a record without a floor: every time taken as measured
    elif floor is None:
        floor = own
    shifts = [0.0 if floor is None else floor - r["timer_floor_us"] for r in records]
    gpus = len({r["gpu"].get("uuid") for r in records})  # a record without a UUID counts as one GPU
    entries = {}
    for case in sorted(common):
        values = [r["cases"][case]["us"] + shift for r, shift in zip(records, shifts, strict=True)]
        entries[case] = Entry(
            round_us(statistics.median(values)),
            round_spread(relative_spread(values)),
            records[0]["cases"][case]["numel"],
            gpus,
        )
    return records[-1]["gpu"], len(records), entries, floor


def merge(old: Mapping[str, Entry], new: Mapping[str, Entry]) -> dict[str, Entry]:
    """The entries to write: an old entry survives when the new value is within the case's
    threshold of it, its spread did not grow and it stands on no fewer GPUs (an entry without the
    count is taken to stand on one: sessions of several GPUs replace it, one GPU's do not); cases
    only in ``old`` are kept."""
    out = dict(old)
    for case, entry in new.items():
        prev = old.get(case)
        threshold = policy.size_class(entry.numel).threshold
        if (
            prev is not None
            and abs(entry.us / prev.us - 1) <= threshold
            and entry.spread <= prev.spread
            and (prev.gpus or 1) >= (entry.gpus or 1)
        ):
            continue
        out[case] = entry
    return dict(sorted(out.items()))


def render(gpu: dict, sessions: int, entries: Mapping[str, Entry], timer_floor_us: float | None = None) -> str:
    """The file's text: one case per line, so a changed value is a one-line diff."""
    head = {"schema": SCHEMA, "gpu": {k: gpu.get(k) for k in GPU_KEYS}, "sessions": sessions}
    if timer_floor_us is not None:
        head["timer_floor_us"] = round(timer_floor_us, 3)
    lines = [json.dumps(head, indent=1)[:-2] + ",", ' "cases": {']
    items = list(entries.items())
    for i, (case, e) in enumerate(items):
        body = json.dumps({"us": e.us, "spread": e.spread, "numel": e.numel} | ({"gpus": e.gpus} if e.gpus else {}))
        lines.append(f"  {json.dumps(case)}: {body}" + ("," if i < len(items) - 1 else ""))
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def save(records: Iterable[dict], directory: Path) -> Path:
    """Combine session records and merge them into this GPU model's baseline file; a file whose
    entries all survive the merge is left untouched. Where the file has a timer floor, the new
    times are moved onto it (a record from another host merges as if timed on the file's);
    where it has none, the records' floor becomes the file's."""
    records = list(records)
    path = path_for(records[-1]["gpu"], directory) if records else None
    old: dict[str, Entry] = {}
    old_floor = None
    if path is not None and path.exists():
        data = json.loads(path.read_text())
        if data.get("schema") == SCHEMA:
            old, old_floor = _entries(data), data.get("timer_floor_us")
    gpu, sessions, entries, floor = combine(records, old_floor)
    floor = old_floor if old_floor is not None else floor
    merged = merge(old, entries)
    if any(merged[case] == entry for case, entry in old.items()):
        # One count for the file: the fewest sessions any of its entries stands on.
        sessions = min(sessions, data["sessions"])
    if merged != old or floor != old_floor or not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(render(gpu, sessions, merged, floor))
    return path


@dataclass(frozen=True)
class DriftRow:
    case: str
    baseline_us: float | None  # the stored value, moved onto this session's timer floor
    measured_us: float
    tolerance: float | None
    status: str  # OK, DRIFTED (slower past tolerance), STALE (faster past it), MISSING
    gpus: int | None = None  # how many GPUs the stored entry stands on (None: not recorded)

    @property
    def change(self) -> float | None:
        return None if self.baseline_us is None else self.measured_us / self.baseline_us - 1


def floor_shift_us(baseline: Baseline, timer_floor_us: float | None) -> float | None:
    """What this session's timer adds to every launch beyond what the baseline's did (None: one of
    the two floors is unknown, and times are compared as measured)."""
    if baseline.timer_floor_us is None or timer_floor_us is None:
        return None
    return timer_floor_us - baseline.timer_floor_us


def check_drift(
    baseline: Baseline, measured_us: Mapping[str, float], timer_floor_us: float | None = None
) -> dict[str, DriftRow]:
    """Each measured case against its pinned value, moved by the difference between this
    session's timer floor and the baseline's (``floor_shift_us``), and its tolerance."""
    shift = floor_shift_us(baseline, timer_floor_us) or 0.0
    rows = {}
    for case, us in measured_us.items():
        entry = baseline.cases.get(case)
        if entry is None:
            rows[case] = DriftRow(case, None, us, None, "MISSING")
            continue
        tol, expected = entry.tolerance(), entry.us + shift
        change = us / expected - 1
        status = "DRIFTED" if change > tol else "STALE" if change < -tol else "OK"
        rows[case] = DriftRow(case, expected, us, tol, status, entry.gpus)
    return rows


STATUSES = ("OK", "DRIFTED", "STALE", "MISSING")


def counts_line(rows: Mapping[str, DriftRow]) -> str:
    """The drift line's clause of counts by status; the drifted or stale entries that stand on one
    GPU are named, since such an entry may hold that GPU's level rather than the model's."""
    parts = []
    for status in STATUSES:
        matching = [r for r in rows.values() if r.status == status]
        if not matching:
            continue
        single = sorted(r.case for r in matching if r.gpus == 1 and status in ("DRIFTED", "STALE"))
        note = f" ({len(single)} stored from one GPU only: {', '.join(single)})" if single else ""
        parts.append(f"{status} {len(matching)}{note}")
    return ", ".join(parts)


def one_gpu_warning(path: Path, records: Iterable[dict]) -> str:
    """After ``save``: a warning naming the file's entries of these records' cases that stand on
    sessions of one GPU ("" where none does)."""
    asked = set.union(*(set(r["cases"]) for r in records))
    single = sorted(c for c, e in _entries(json.loads(path.read_text())).items() if c in asked and e.gpus == 1)
    if not single:
        return ""
    return (
        f"warning: {len(single)} {'entry stands' if len(single) == 1 else 'entries stand'} on sessions of "
        f"one GPU ({', '.join(single)}); the drift "
        "check cannot tell that GPU's level from its model's: add sessions from another GPU"
    )


def floor_line(baseline: Baseline, timer_floor_us: float | None) -> str:
    """The drift line's clause on the timer floor."""
    if timer_floor_us is None:
        return "this session's timer floor not measured: compared as measured"
    shift = floor_shift_us(baseline, timer_floor_us)
    if shift is None:
        return f"timer floor {timer_floor_us:.2f} µs, none stored (re-record to keep one): compared as measured"
    return (
        f"timer floor {timer_floor_us:.2f} µs, {baseline.timer_floor_us:.2f} when recorded: "
        f"each stored time moved by {shift:+.2f} µs"
    )


def only_cases(record: dict, patterns: Iterable[str]) -> dict:
    """``record`` cut to the cases matching any of the shell-style ``patterns``: for a change that
    moved some cases only, so that the others keep the sessions (hosts) they stand on."""
    patterns = list(patterns)
    cases = {c: v for c, v in record["cases"].items() if any(fnmatch.fnmatchcase(c, p) for p in patterns)}
    if not cases:
        raise ValueError(f"no case of the record matches {patterns}")
    return {**record, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.perf.baseline",
        description="Combine perf session records (one per session/machine) into baselines/<gpu>.json.",
    )
    parser.add_argument("records", nargs="+", type=Path, help="session-record.json files written by nox -s perf")
    parser.add_argument("--dir", type=Path, default=Path("baselines"), help="baseline directory (default: baselines)")
    parser.add_argument(
        "--cases", action="append", metavar="PATTERN",
        help="merge only the cases matching this shell-style pattern (repeatable; default: every case)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    records = [json.loads(p.read_text()) for p in args.records]
    if args.cases:
        records = [only_cases(r, args.cases) for r in records]
    path = save(records, args.dir)
    print(f"baseline: {path}")
    if warning := one_gpu_warning(path, records):
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
