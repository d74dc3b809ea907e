"""Correctness audit -> results/audit/gates.json and audit.md: the gates of parity.py
at the profile's shapes and dtypes. Any failure exits non-zero, so no timing stage runs."""

import sys

import torch

from common import atomic, facts, records, stage
from common.cases import step_option_sets

import parity


def run_checks(settings: dict, step_grids: dict | None = None) -> list[dict]:
    """Every gate per dtype, in the profile's `workers` processes; the decode steps also with every option set of
    `step_grids` (the tune stage's candidates), so each step kernel the tuning table may choose is gated here first."""
    options, device, workers = step_option_sets(step_grids or {}), settings["device"], settings.get("workers", 1)
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the profile's audit runs on cuda but no GPU is visible; pick the cpu-smoke profile")
    checks = []
    for dtype_name in settings["dtypes"]:
        for i, backend in enumerate(settings["model_backends"]):
            shapes = dict(settings["gates"])
            if "steps" in shapes and options:
                shapes["steps"] = [{**kw, "options": options} for kw in shapes["steps"]]
            if i > 0:   # gates that do not depend on the model backend run once
                shapes.update(backends=[], samu_reference=[], steps=[])
            if backend != "auto":
                shapes["captured_train"] = []  # the captured step is timed with the tuned kernels only
            rows = parity.run_gates(shapes, device, getattr(torch, dtype_name), backend, workers)
            checks += [{"model_backend": backend, **r, "dtype": dtype_name} for r in rows]
            print(f"audit: {dtype_name}, model backend {backend}: {len(rows)} checks, "
                  f"{len(parity.failures(rows))} failed", flush=True)
    return checks


def _fmt(v) -> str:
    return f"{v:.3e}" if isinstance(v, float) else "" if v is None else str(v)


def markdown(doc: dict) -> str:
    checks = doc["checks"]
    lines = [f"# Correctness audit ({doc['profile']})", "",
             f"{sum(c['passed'] for c in checks)} of {len(checks)} checks passed on {doc['device_name']} "
             f"(commit {doc['commit']['sha'][:12]}{' dirty' if doc['commit']['dirty'] else ''}, "
             f"torch {doc['versions'].get('torch')}, triton {doc['versions'].get('triton')}).",
             "Errors are maximum relative errors against the reference named in each check; "
             "a check passes when its error is at most its tolerance.", "",
             "| check | dtype | error | tolerance | passed | context |", "|---|---|---|---|---|---|"]
    shown = ("check", "error", "tolerance", "passed", "dtype", "device")  # context: the check's other keys
    lines += [f"| {c['check']} | {c.get('dtype', '')} | {_fmt(c.get('error'))} | {_fmt(c.get('tolerance'))} | "
              f"{'yes' if c['passed'] else '**NO**'} | "
              + ", ".join(f"{k}={v}" for k, v in c.items() if k not in shown) + " |" for c in checks]
    return "\n".join(lines) + "\n"


def main(job):
    checks = run_checks(job.params["settings"], job.params.get("step_grids"))
    gpu = facts.gpu()
    doc = {"schema": 1, "profile": job.profile, "timestamp": records.now(), "commit": facts.commit(),
           "versions": facts.versions(), "gpu": gpu, "device_name": gpu["name"] if gpu else "CPU",
           "settings": job.params["settings"], "passed": bool(checks) and all(c["passed"] for c in checks),
           "checks": checks}
    text = markdown(doc)
    print(text, flush=True)
    if not checks:
        raise SystemExit("audit: parity returned no checks; refusing to pass an empty audit")
    if not doc["passed"]:
        failed = [c["check"] for c in checks if not c["passed"]]
        print(f"audit: {len(failed)} gate(s) failed: {failed}; no timing stage will run", file=sys.stderr)
        raise SystemExit(1)
    atomic.write_json(job.output.gates, doc)
    atomic.write_text(job.output.summary, text)


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
