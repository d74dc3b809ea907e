"""Kernel choice as a value: `Backend` (a backend name and its launcher options) and
`TuningTable` (what backend="auto" reads: the caller's table, else the one at
$KERNELS_TUNING_TABLE, read once; a table tuned on another GPU is not used, with one
warning per pair of names). Schema version 1:

    {"schema": 1, "gpu": "<name>", "entries": [
        {"op": "rglru" | "samu" | "scan", "dtype": "bfloat16", "B": 4, "T": 2048, "D": 2560,
         "backend": "chunk", "chunk_size": 32, "options": {...launcher keyword arguments...}}],
     "decode_linears": [{"role": "xy" | "out" | "up" | "down" | "logits", "dtype": "bfloat16",
                         "rows": 16, "config": {...kernels.models.decode.CONFIG_KEYS...}}],
     "decode": [{"op": "rglru_step" | "samu_step", "dtype": "bfloat16", "B": 16,
                 "backend": "fused", "options": {...}}]}
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import warnings
from pathlib import Path

SCHEMA = 1
ENV = "KERNELS_TUNING_TABLE"
# per section: the keys every entry has, and the one that must be a dict if present
SECTIONS = {"entries": (("op", "dtype", "B", "T", "D", "backend"), "options"),
            "decode_linears": (("role", "dtype", "rows", "config"), "config"),
            "decode": (("op", "dtype", "B", "backend"), "options")}


def validate_table(table: dict) -> dict:
    if not isinstance(table, dict) or table.get("schema") != SCHEMA:
        raise ValueError(f"expected a tuning table with schema {SCHEMA}, got {str(table)[:80]}")
    for section, (keys, dict_key) in SECTIONS.items():
        for i, e in enumerate(table.get(section, [])):
            missing = [k for k in keys if k not in e]
            if missing or not isinstance(e.get(dict_key, {}), dict):
                raise ValueError(f"expected every {section} entry with keys {list(keys)} (and {dict_key} a dict), "
                                 f"got entry {i} lacking {missing}: {e}")
    return table


class TuningTable:
    """The entries of a tuning table (schema above) and the GPU they were tuned on. `gpu`
    arguments: the caller's GPU name (None: not checked)."""

    def __init__(self, doc: dict, source: str = "given"):
        validate_table(doc)
        self.gpu, self.source, self._found = doc.get("gpu"), source, {}
        self.entries, self.linears, self.steps = (tuple(doc.get(section, ())) for section in SECTIONS)

    @classmethod
    def load(cls, path) -> "TuningTable":
        return cls(json.loads(Path(path).read_text()), source=str(path))

    @classmethod
    def from_dict(cls, doc: dict) -> "TuningTable":
        return cls(doc)

    def __repr__(self) -> str:
        return f"TuningTable({self.source!r}, gpu={self.gpu!r}, {len(self.entries)} entries)"

    def _other_gpu(self, gpu: str | None) -> bool:
        if gpu and self.gpu and self.gpu != gpu:
            _warn_other_gpu(self.gpu, gpu, self.source)
            return True
        return False

    def lookup(self, op: str, dtype: str, B: int, T: int, D: int, gpu: str | None = None) -> dict | None:
        """The entry of `op` and `dtype` nearest in log(B*T), log(D) and log(B), or None (cached)."""
        key = (op, dtype, B, T, D, gpu)
        if key not in self._found:
            cands = [] if self._other_gpu(gpu) else [e for e in self.entries if e["op"] == op and e["dtype"] == dtype]
            # the tokens, the width, and the batch alone: the serial kernels' programs are
            # B x D / block, so B1 T8192 and B4 T2048 (equal tokens) run differently
            self._found[key] = min(cands, default=None, key=lambda e: sum(
                abs(math.log(max(a, 1) / max(b, 1))) for a, b in ((e["B"] * e["T"], B * T), (e["D"], D), (e["B"], B))))
        return self._found[key]

    def linear_configs(self, dtype: str, rows: int, gpu: str | None = None) -> dict[str, dict]:
        """Tile options of the decode linears by role tuned for `rows` rows per launch
        (kernels.models.decode.rows_block), {} where none are."""
        if self._other_gpu(gpu):
            return {}
        return {e["role"]: dict(e["config"]) for e in self.linears if e["dtype"] == dtype and e["rows"] == rows}

    def step_choice(self, op: str, dtype: str, B: int, gpu: str | None = None,
                    backends: tuple | None = None) -> dict | None:
        """The decode entry of `op` ("rglru_step", "samu_step") and dtype nearest in log(B) (of
        two equally near, the larger batch's) among those naming one of `backends` (None: any), or None."""
        if self._other_gpu(gpu):
            return None
        cands = [e for e in self.steps if e["op"] == op and e["dtype"] == dtype
                 and (backends is None or e["backend"] in backends)]
        return min(cands, default=None, key=lambda e: (abs(math.log(max(e["B"], 1) / max(B, 1))), -e["B"]))


@functools.lru_cache(maxsize=None)
def _warn_other_gpu(tuned: str, gpu: str, source: str) -> None:
    warnings.warn(f"the tuning table {source} was tuned on {tuned!r}, not on this {gpu!r}: backend='auto' uses "
                  f"its built-in defaults (tune on this GPU and pass that table)", RuntimeWarning, stacklevel=6)


@functools.cache
def env_table() -> TuningTable | None:
    """The table at $KERNELS_TUNING_TABLE, read once per process (None when unset)."""
    path = os.environ.get(ENV)
    if not path:
        return None
    if not Path(path).is_file():
        raise ValueError(f"expected ${ENV} to name a tuning table file, got {path!r} (no such file)")
    return TuningTable.load(path)


@dataclasses.dataclass(frozen=True, eq=False, repr=False, init=False)
class Backend:
    """A backend name and its launcher options ("auto" may carry a `table`); immutable and
    hashable, so resolutions can be cached on it. A plain name equals its string."""

    name: str
    options: dict
    table: TuningTable | None
    _key: object

    def __init__(self, name: str = "auto", table: TuningTable | None = None, **options):
        if not isinstance(name, str):
            raise ValueError(f"expected a backend name (str), got {type(name).__name__}")
        if table is not None and (name != "auto" or not isinstance(table, TuningTable)):
            raise ValueError(f"expected table (a TuningTable) only with the backend 'auto', got "
                             f"{type(table).__name__} with {name!r}")
        if name == "auto" and options:
            raise ValueError(f"expected no launcher options with the backend 'auto' (the table chooses them), "
                             f"got {sorted(options)}")
        # a plain name keys (and hashes) as its string
        key = name if not options and table is None else (name, tuple(sorted(options.items())), id(table))
        for k, v in (("name", name), ("options", dict(options)), ("table", table), ("_key", key)):
            object.__setattr__(self, k, v)

    def __deepcopy__(self, memo):
        return self

    def __eq__(self, other):
        if isinstance(other, str):
            return self._key == other
        return isinstance(other, Backend) and self._key == other._key and self.table is other.table

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        opts = "".join(f", {k}={v!r}" for k, v in sorted(self.options.items()))
        tab = f", table={self.table!r}" if self.table is not None else ""
        return f"Backend({self.name!r}{tab}{opts})"

    @classmethod
    def of(cls, value) -> "Backend":
        """A Backend from a Backend or a name."""
        if isinstance(value, Backend):
            return value
        if not isinstance(value, str):
            raise ValueError(f"expected backend to be a name (str) or a kernels.Backend, got {type(value).__name__}")
        return _named(value)


_named = functools.lru_cache(maxsize=None)(Backend)


__all__ = ["Backend", "TuningTable", "env_table", "validate_table", "ENV", "SCHEMA"]
