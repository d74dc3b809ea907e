"""The tuning table that `backend="auto"` reads.

The pipeline's tune stage writes it (default `results/tune/tuning.json`, or the
path in the environment variable KERNELS_TUNING_TABLE). Schema version 1:

    {"schema": 1, "gpu": "<name>", "entries": [
        {"op": "rglru" | "samu" | "scan", "dtype": "bfloat16", "B": 4, "T": 2048, "D": 2560,
         "backend": "chunk", "chunk_size": 32, "options": {...launcher keyword arguments...}}]}

Lookup takes the entry of the same op and dtype nearest in log(B*T) and log(D).
A table tuned on another GPU than the caller's (both names known, different) is not
used: a warning names both, once per pair. Without a table (or without a matching
entry) a fixed default applies.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from functools import lru_cache
from pathlib import Path

SCHEMA = 1
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATH = REPO_ROOT / "results" / "tune" / "tuning.json"
REQUIRED_KEYS = ("op", "dtype", "B", "T", "D", "backend")


def table_path() -> Path:
    return Path(os.environ.get("KERNELS_TUNING_TABLE", DEFAULT_PATH))


def validate_table(table: dict) -> dict:
    if not isinstance(table, dict) or table.get("schema") != SCHEMA:
        raise ValueError(f"expected a tuning table with schema {SCHEMA}, got {str(table)[:80]}")
    for i, e in enumerate(table.get("entries", [])):
        missing = [k for k in REQUIRED_KEYS if k not in e]
        if missing:
            raise ValueError(f"tuning table entry {i} lacks keys {missing}: {e}")
    return table


@lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> dict:
    with open(path) as f:
        return validate_table(json.load(f))


def load_table(path: Path | None = None) -> dict | None:
    p = Path(path) if path is not None else table_path()
    if not p.is_file():
        return None
    return _load(str(p), p.stat().st_mtime)


@lru_cache(maxsize=None)
def _warn_other_gpu(tuned: str, gpu: str, path: str) -> None:
    warnings.warn(f"the tuning table {path} was tuned on {tuned!r}, not on this {gpu!r}: backend='auto' uses "
                  f"its built-in defaults (run the pipeline's tune stage on this GPU, or point "
                  f"KERNELS_TUNING_TABLE at a table for it)", RuntimeWarning, stacklevel=4)


def lookup(op: str, dtype: str, B: int, T: int, D: int, table: dict | None = None,
           gpu: str | None = None) -> dict | None:
    """The entry for a call, or None. `gpu`: the caller's GPU name (None: not checked)."""
    path = "given" if table is not None else str(table_path())
    table = table if table is not None else load_table()
    if not table:
        return None
    tuned = table.get("gpu")
    if gpu and tuned and tuned != gpu:
        _warn_other_gpu(tuned, gpu, path)
        return None
    cands = [e for e in table.get("entries", []) if e["op"] == op and e["dtype"] == dtype]
    if not cands:
        return None

    def dist(e):
        return abs(math.log(max(e["B"] * e["T"], 1) / max(B * T, 1))) + abs(math.log(max(e["D"], 1) / max(D, 1)))

    return min(cands, key=dist)
