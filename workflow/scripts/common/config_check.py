"""Checks of the configuration that run while the Snakefile is parsed, before any job.

- `typed_overrides`: Snakemake parses a nested `--config` value
  (`--config "profiles={cpu-smoke: {probe: {reps: 5}}}"`) with YAML's base loader,
  which leaves every scalar a string; the scalars inside such a value are read
  again as YAML scalars (`5` -> 5, `1.0e-4` -> 0.0001, `true` -> True, `null` ->
  None, `1.3b` stays a string), so that an override has the type the same text
  has in config.yaml.
- `schema_errors`: the schema's complaints, one short line each (the key path and
  what is wrong), instead of Snakemake's message, which prints the whole config.
- `require_device`: a profile whose stages run on CUDA is refused on a machine
  with no visible GPU, at parse time rather than after the probe.
"""

from __future__ import annotations

from pathlib import Path

import yaml

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
    """`--config` entries with the scalars inside nested values typed as YAML would
    type them; top-level values (already parsed by Snakemake) are kept."""
    return {k: _typed(v) if isinstance(v, (dict, list)) else v for k, v in overrides.items()}


def schema_errors(config: dict, schema_path: str | Path) -> list[str]:
    """One line per schema violation: `profiles.cpu-smoke.probe.reps: 'many' is not
    of type 'integer'`. An empty list means the config is valid."""
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    path = Path(schema_path).resolve()
    schema = yaml.safe_load(path.read_text())
    schema["$id"] = path.as_uri()
    registry = Registry().with_resource(path.as_uri(), Resource.from_contents(schema))
    validator = Draft202012Validator(schema, registry=registry)
    out = []
    for err in sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path]):
        where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        msg = err.message
        if len(msg) > MAX_MESSAGE:
            msg = msg[:MAX_MESSAGE] + " ..."
        out.append(f"{where}: {msg}")
    return out


def cuda_sections(profile: dict) -> list[str]:
    """The stages of a profile that need a CUDA GPU (its audit device is cuda)."""
    return ["audit.device"] if (profile.get("audit") or {}).get("device") == "cuda" else []


def require_device(name: str, profile: dict, gpus: list[str]) -> None:
    """Raise ValueError when profile `name` needs a GPU and `gpus` is empty."""
    needs = cuda_sections(profile)
    if needs and not gpus:
        raise ValueError(
            f"profile {name!r} runs on CUDA ({', '.join(needs)}: cuda) but no GPU is visible "
            f"(NVML lists none, or CUDA_VISIBLE_DEVICES hides them); on this machine run "
            f"--config profile=cpu-smoke"
        )
