"""The one result schema (version 1) of the measuring stages: one JSON object per
configuration, written atomically to `records.d/<config_id>.json` as soon as it finishes
(what a resumed stage skips) and concatenated into the rule's `records.jsonl`."""

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


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


# (key, test of the value in its record, what is expected), in the order checked
CHECKS = (
    ("schema", lambda v, r: v == SCHEMA, f"== {SCHEMA}"),
    ("config_id", lambda v, r: isinstance(v, str) and bool(CONFIG_ID.match(v)),
     f"matching {CONFIG_ID.pattern} (it names a file)"),
    *((k, lambda v, r: isinstance(v, str) and bool(v), "a non-empty string")
      for k in ("stage", "profile", "timestamp")),
    *((k, lambda v, r: v is None or isinstance(v, str), "a string or null") for k in ("mixer", "backend", "order")),
    ("shapes", lambda v, r: isinstance(v, dict), "an object"),
    ("status", lambda v, r: v in STATUSES, f"in {list(STATUSES)}"),
    ("error", lambda v, r: r["status"] == "ok" or (isinstance(v, str) and bool(v)), "a message unless status is 'ok'"),
    ("samples_ms", lambda v, r: isinstance(v, list) and all(map(_is_number, v)) and (bool(v) or r["status"] != "ok"),
     "a list of numbers, non-empty when status is 'ok'"),
    ("stats", lambda v, r: isinstance(v, dict) and all(_is_number(v.get(k)) for k in STATS_KEYS)
     if r["status"] == "ok" else v is None or isinstance(v, dict),
     f"an object with numbers {list(STATS_KEYS)} when status is 'ok', else an object or null"),
    ("logical", lambda v, r: v is None or (isinstance(v, dict) and all(
        k in v and (v[k] is None or _is_number(v[k])) for k in LOGICAL_KEYS)),
     f"null or an object with numbers (or null for a figure not counted) under {list(LOGICAL_KEYS)}"),
    *((k, lambda v, r: v is None or isinstance(v, dict), "an object or null") for k in ("counters", "gpu")),
    ("peak_bytes", lambda v, r: v is None or _is_number(v), "a number or null"),
    ("versions", lambda v, r: isinstance(v, dict), "an object"),
    ("commit", lambda v, r: isinstance(v, dict) and "sha" in v, "an object with 'sha' and 'dirty'"),
)
REQUIRED = tuple(key for key, _, _ in CHECKS)


def validate(rec) -> dict:
    """Return `rec` if it follows schema 1, else raise ValueError naming the field."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a record object, got {type(rec).__name__}")
    if missing := [k for k in REQUIRED if k not in rec]:
        raise ValueError(f"record {rec.get('config_id', '?')!r} lacks keys {missing}")
    for key, test, expected in CHECKS:
        if not test(rec[key], rec):
            raise ValueError(f"record {rec['config_id']!r}: expected {key} {expected}, got {rec[key]!r:.200}")
    return rec


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_record(stage: str, profile: str, config_id: str, **fields) -> dict:
    """A record with the run facts filled in; `fields` override any key."""
    return {"schema": SCHEMA, "stage": stage, "profile": profile, "config_id": config_id, "shapes": {},
            "mixer": None, "backend": None, "order": None, "status": "ok", "error": None, "samples_ms": [],
            "stats": None, "logical": None, "counters": None, "peak_bytes": None, "gpu": facts.gpu(),
            "versions": facts.versions(), "commit": facts.commit(), "timestamp": now(), **fields}


def classify_error(exc: BaseException) -> tuple[str, str]:
    """("oom" | "failed", message) for an exception raised by one configuration."""
    oom = type(exc).__name__ in ("OutOfMemoryError", "MemoryError") or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())
    return ("oom" if oom else "failed"), f"{type(exc).__name__}: {exc}".strip()[:2000]


def record_path(directory: str | Path, config_id: str) -> Path:
    if not isinstance(config_id, str) or not CONFIG_ID.match(config_id):
        raise ValueError(f"expected config_id matching {CONFIG_ID.pattern}, got {config_id!r}")
    return Path(directory) / f"{config_id}.json"


def write_record(directory: str | Path, rec: dict) -> Path:
    rec = validate(json.loads(atomic.dumps(rec)))
    return atomic.write_text(record_path(directory, rec["config_id"]), atomic.dumps(rec) + "\n")


def read_record(path: str | Path) -> dict | None:
    """The record in `path`; None if unreadable, invalid or named after another config_id."""
    path = Path(path)
    try:
        rec = validate(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    return rec if rec["config_id"] == path.stem else None


def done_ids(directory: str | Path, profile: str | None = None) -> set[str]:
    """config_ids with a valid record (of `profile`): failed and OOM ones are finished work too."""
    recs = (read_record(p) for p in Path(directory).glob("*.json"))     # none where the folder is missing
    return {r["config_id"] for r in recs if r is not None and profile in (None, r["profile"])}


def collect(directory: str | Path, out_jsonl: str | Path, profile: str | None = None, ids=None) -> list[dict]:
    """Concatenate the records (of `profile`, of `ids`) into `out_jsonl`; an invalid one is an error."""
    wanted = None if ids is None else set(ids)
    paths = [p for p in sorted(Path(directory).glob("*.json")) if wanted is None or p.stem in wanted]
    recs = [read_record(p) for p in paths]
    if bad := [str(p) for p, rec in zip(paths, recs) if rec is None]:
        raise ValueError(f"invalid or truncated records (rerun the stage to redo them): {bad}")
    recs = [rec for rec in recs if profile in (None, rec["profile"])]
    if missing := sorted((wanted or set()) - {r["config_id"] for r in recs}):
        raise ValueError(f"no record for configurations {missing} in {directory}")
    atomic.write_text(out_jsonl, "".join(atomic.dumps(r, indent=None) + "\n" for r in recs))
    return recs


def read_jsonl(path: str | Path) -> list[dict]:
    out = []
    for n, line in enumerate(Path(path).read_text().split("\n"), 1):
        if line.strip():
            try:
                out.append(validate(json.loads(line)))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return out
