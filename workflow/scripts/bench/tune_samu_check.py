"""The tune stage's SAMU part alone, with the h200 profile's settings: every SAMU
candidate (the look-back forward among them) checked against the reference and timed by
tune.tune_ops, the same code the pipeline runs; records and the would-be table entry
under --out. A check that the tune grid's fwd option works on the GPU, not a stage run.

    python workflow/scripts/bench/tune_samu_check.py --out DIR [--profile h200]
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "workflow" / "scripts")]

import torch  # noqa: E402
import yaml  # noqa: E402

import tune  # noqa: E402
from common import measure  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", default="h200")
    args = ap.parse_args()
    cfg = yaml.safe_load(open(ROOT / "config.yaml"))
    settings = dict(cfg["profiles"][args.profile]["tune"])
    settings["shapes"] = {"samu": settings["shapes"]["samu"]}
    if not torch.cuda.is_available():
        settings["shapes"] = {"samu": [{"B": 1, "T": 20, "D": 8}]}
        settings["dtype"], settings["reps"], settings["fresh_reps"] = "float32", 2, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    runner = measure.Runner("tune", args.profile, out / "records.d", settings.get("budget_s"), device)
    entries = tune.tune_ops(runner, settings, None, device, print)
    (out / "entries.json").write_text(json.dumps(entries, indent=1, default=str))
    recs = []
    for p in sorted((out / "records.d").glob("*.json")):
        r = json.loads(p.read_text())
        recs.append((r["config_id"], r["status"], (r.get("stats") or {}).get("median_ms"), r.get("error")))
    for cid, status, med, err in recs:
        print(f"{cid:90s} {status:8s} {med if med is None else round(med, 4)} {'' if not err else str(err)[:120]}")
    print(json.dumps(entries, default=str)[:1500])


if __name__ == "__main__":
    main()
