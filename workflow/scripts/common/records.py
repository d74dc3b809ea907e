"""The one result schema of the pipeline's measurement stages.

One self-describing JSON object per configuration (schema version 1):

    {"schema": 1, "stage": "scan", "profile": "h200", "config_id": "rglru-chunk32-T2048-AB",
     "shapes": {"B": 8, "T": 2048, "D": 1024}, "mixer": "rglru", "backend": "chunk",
     "order": "AB" | "BA" | null, "status": "ok" | "oom" | "failed", "error": null | "<message>",
     "samples_ms": [...], "stats": {"p10_ms", "median_ms", "p95_ms", ...} | null,
     "logical": {"bytes_read", "bytes_written", "param_bytes", "state_bytes", "launches"} | null,
     "counters": {...} | null, "peak_bytes": int | null,
     "gpu": {...} | null, "versions": {...}, "commit": {"sha", "dirty"}, "timestamp": "<UTC ISO 8601>"}

Extra keys are allowed (a stage adds what it measures: tokens_per_s, mfu, ...).
`logical` figures come from the launchers' own accounting and are labelled
logical; `counters` holds hardware counters only when the probe found them
readable, otherwise null -- never a theoretical figure in their place.

A stage writes each record atomically into `<track>/records.d/<config_id>.json`
as soon as the configuration finishes (`write_record`); on a restart
`done_ids` names the configurations to skip (a truncated or invalid file is not
done, so it is measured again), and `collect` concatenates the records into the
rule's declared output `records.jsonl`.
"""

from __future__ import annotations

import datetime as _dt
import json
import numbers
import re
from pathlib import Path

from . import atomic, facts

SCHEMA = 1
STATUSES = ("ok", "oom", "failed")
LOGICAL_KEYS = ("bytes_read", "bytes_written", "param_bytes", "state_bytes", "launches")
STATS_KEYS = ("p10_ms", "median_ms", "p95_ms")
CONFIG_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}$")
REQUIRED = (
    "schema", "stage", "profile", "config_id", "shapes", "mixer", "backend", "order", "status",
    "error", "samples_ms", "stats", "logical", "counters", "peak_bytes", "gpu", "versions",
    "commit", "timestamp",
)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def validate(rec) -> dict:
    """Return `rec` if it follows schema 1, else raise ValueError naming the field."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a record object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise ValueError(f"record {rec.get('config_id', '?')!r} lacks keys {missing}")
    cid = rec["config_id"]

    def bad(key, expected):
        return ValueError(f"record {cid!r}: expected {key} {expected}, got {rec.get(key)!r:.200}")

    if rec["schema"] != SCHEMA:
        raise bad("schema", f"== {SCHEMA}")
    if not isinstance(cid, str) or not CONFIG_ID.match(cid):
        raise bad("config_id", f"matching {CONFIG_ID.pattern} (it names a file)")
    for key in ("stage", "profile", "timestamp"):
        if not isinstance(rec[key], str) or not rec[key]:
            raise bad(key, "a non-empty string")
    for key in ("mixer", "backend", "order"):
        if rec[key] is not None and not isinstance(rec[key], str):
            raise bad(key, "a string or null")
    if not isinstance(rec["shapes"], dict):
        raise bad("shapes", "an object")
    if rec["status"] not in STATUSES:
        raise bad("status", f"in {list(STATUSES)}")
    if rec["status"] != "ok" and not (isinstance(rec["error"], str) and rec["error"]):
        raise bad("error", f"a message when status is {rec['status']!r}")
    samples = rec["samples_ms"]
    if not isinstance(samples, list) or not all(_is_number(s) for s in samples):
        raise bad("samples_ms", "a list of numbers")
    if rec["status"] == "ok":
        if not samples:
            raise bad("samples_ms", "non-empty when status is 'ok'")
        stats = rec["stats"]
        if not isinstance(stats, dict) or not all(_is_number(stats.get(k)) for k in STATS_KEYS):
            raise bad("stats", f"an object with numbers {list(STATS_KEYS)}")
    elif rec["stats"] is not None and not isinstance(rec["stats"], dict):
        raise bad("stats", "an object or null")
    logical = rec["logical"]
    if logical is not None:
        if not isinstance(logical, dict) or any(k not in logical for k in LOGICAL_KEYS):
            raise bad("logical", f"null or an object with keys {list(LOGICAL_KEYS)}")
        if any(logical[k] is not None and not _is_number(logical[k]) for k in LOGICAL_KEYS):
            raise bad("logical", "numbers (or null for a figure not counted)")
    if rec["counters"] is not None and not isinstance(rec["counters"], dict):
        raise bad("counters", "an object or null")
    if rec["peak_bytes"] is not None and not _is_number(rec["peak_bytes"]):
        raise bad("peak_bytes", "a number or null")
    if rec["gpu"] is not None and not isinstance(rec["gpu"], dict):
        raise bad("gpu", "an object or null")
    if not isinstance(rec["versions"], dict):
        raise bad("versions", "an object")
    if not isinstance(rec["commit"], dict) or "sha" not in rec["commit"]:
        raise bad("commit", "an object with 'sha' and 'dirty'")
    return rec


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_record(stage: str, profile: str, config_id: str, **fields) -> dict:
    """A record with the run facts (GPU, versions, commit, time) filled in and the
    measurement fields defaulted to empty; `fields` override any of them."""
    rec = {
        "schema": SCHEMA,
        "stage": stage,
        "profile": profile,
        "config_id": config_id,
        "shapes": {},
        "mixer": None,
        "backend": None,
        "order": None,
        "status": "ok",
        "error": None,
        "samples_ms": [],
        "stats": None,
        "logical": None,
        "counters": None,
        "peak_bytes": None,
        "gpu": facts.gpu(),
        "versions": facts.versions(),
        "commit": facts.commit(),
        "timestamp": now(),
    }
    rec.update(fields)
    return rec


def classify_error(exc: BaseException) -> tuple[str, str]:
    """("oom" | "failed", message) for an exception raised by one configuration."""
    msg = f"{type(exc).__name__}: {exc}".strip()
    oom = type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()
    return ("oom" if oom else "failed"), msg[:2000]


def record_path(directory: str | Path, config_id: str) -> Path:
    if not isinstance(config_id, str) or not CONFIG_ID.match(config_id):
        raise ValueError(f"expected config_id matching {CONFIG_ID.pattern}, got {config_id!r}")
    return Path(directory) / f"{config_id}.json"


def write_record(directory: str | Path, rec: dict) -> Path:
    """Validate and atomically write one record; returns its path."""
    rec = json.loads(atomic.dumps(rec))
    validate(rec)
    return atomic.write_text(record_path(directory, rec["config_id"]), atomic.dumps(rec) + "\n")


def read_record(path: str | Path) -> dict | None:
    """The record in `path`, or None if it is unreadable, truncated or invalid, or
    its config_id does not match its file name."""
    path = Path(path)
    try:
        rec = validate(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    return rec if rec["config_id"] == path.stem else None


def _files(directory: str | Path) -> list[Path]:
    d = Path(directory)
    return sorted(d.glob("*.json")) if d.is_dir() else []


def done_ids(directory: str | Path, profile: str | None = None) -> set[str]:
    """config_ids with a valid record (of `profile`, when given) in `directory`.
    Failed and OOM configurations are finished work too; only missing, truncated
    or invalid records are not done."""
    out = set()
    for path in _files(directory):
        rec = read_record(path)
        if rec is not None and (profile is None or rec["profile"] == profile):
            out.add(rec["config_id"])
    return out


def collect(directory: str | Path, out_jsonl: str | Path, profile: str | None = None, ids=None) -> list[dict]:
    """Concatenate the records (of `profile`, restricted to `ids` when given) into
    `out_jsonl`, one per line, sorted by config_id; written atomically. An invalid
    file among the selected ones is an error: the stage should have redone it."""
    wanted = None if ids is None else set(ids)
    recs, bad = [], []
    for path in _files(directory):
        if wanted is not None and path.stem not in wanted:
            continue
        rec = read_record(path)
        if rec is None:
            bad.append(str(path))
        elif profile is None or rec["profile"] == profile:
            recs.append(rec)
    if bad:
        raise ValueError(f"invalid or truncated records (rerun the stage to redo them): {bad}")
    if wanted is not None:
        missing = sorted(wanted - {r["config_id"] for r in recs})
        if missing:
            raise ValueError(f"no record for configurations {missing} in {directory}")
    text = "".join(atomic.dumps(r, indent=None) + "\n" for r in recs)
    atomic.write_text(out_jsonl, text)
    return recs


def read_jsonl(path: str | Path) -> list[dict]:
    """Every record of a records.jsonl file, each validated."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(validate(json.loads(line)))
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: {e}") from None
    return out
