"""Checks of the configuration at parse time: nested `--config` overrides typed as YAML
would type them, schema errors one short line each, a CUDA profile refused without a GPU."""

from __future__ import annotations

from pathlib import Path

import yaml
from jsonschema import Draft202012Validator

MAX_MESSAGE = 300


def _typed(value):
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if isinstance(value, str):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return parsed if parsed is None or isinstance(parsed, (bool, int, float, str)) else value
    return value


def typed_overrides(overrides: dict) -> dict:
    """`--config` entries with nested scalars read again as YAML scalars (`5` -> 5, `1.3b` stays)."""
    return {k: _typed(v) if isinstance(v, (dict, list)) else v for k, v in overrides.items()}


def validate(config: dict, schema_path: str | Path) -> None:
    """Raise ValueError with one line per schema violation (Snakemake's own message prints the config)."""
    validator = Draft202012Validator(yaml.safe_load(Path(schema_path).read_text()))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '(top level)'}: {e.message[:MAX_MESSAGE]}"
              f"{' ...' if len(e.message) > MAX_MESSAGE else ''}"
              for e in sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])]
    if errors:
        raise ValueError("Error validating config file:\n  " + "\n  ".join(errors))


def require_device(name: str, profile: dict, gpus: list[str]) -> None:
    """Raise ValueError when profile `name` runs on CUDA (audit.device) and `gpus` is empty."""
    if (profile.get("audit") or {}).get("device") == "cuda" and not gpus:
        raise ValueError(f"profile {name!r} runs on CUDA (audit.device: cuda) but no GPU is visible (NVML lists "
                         "none, or CUDA_VISIBLE_DEVICES hides them); on this machine run --config profile=cpu-smoke")
