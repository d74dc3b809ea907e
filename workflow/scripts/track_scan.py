"""Scan track -> results/tracks/scan/records.jsonl: Griffin's Fig. 8a shape, forward only, every backend of every op in
both orders, with the memory floor and hardware counters from one Nsight Compute pass where readable."""

import itertools
import json
import os
import sys
from pathlib import Path

import torch

from common import atomic, cases, measure, stage
from common.cases import chunk_variants, floor_bytes, op_inputs, opt_tag

import kernels

COUNTERS_PASS = "KERNELS_SCAN_COUNTERS_PASS"
# Left out of the Nsight Compute pass: PyTorch per-step loops and associative scans
# (thousands of small kernels, each replayed by the profiler).
COUNTERS_SKIP = ("reference", "assoc", "assoc_bf16")


def plan(settings: dict, gates: dict | None) -> list[dict]:
    """Every (op, backend, options, T) of the track in listed order, per T."""
    out, wanted = [], settings.get("backends")
    for T, op in itertools.product(settings["T"], settings["ops"]):
        fns = kernels.backends(op)
        names, exact = cases.diagnostic_backend_names(op, fns, gates)
        out += [{"T": T, "op": op, "backend": n, "options": opts, "exact": n in exact} for n in names
                if (not wanted or n in wanted) and (n != "reference" or T <= settings.get("reference_max_T", 0))
                for opts in chunk_variants(n, fns[n], settings["chunk_sizes"])]
    return out


def config_id(item: dict, settings: dict, order: str) -> str:
    return (f"scan-{item['op']}-{item['backend']}{opt_tag(item['options'])}-B{settings['B']}-T{item['T']}"
            f"-D{settings['D']}-{settings['dtype']}-{order}")


def inputs(s: dict, device):
    """call(item) -> (the timed forward of `item`, its arguments); one (op, T)'s inputs held at a time."""
    held = {}

    def call(item: dict):
        key = (item["op"], item["T"])
        if key not in held:
            held.clear()
            measure.release(device)
            held[key] = op_inputs(item["op"], s["B"], item["T"], s["D"], getattr(torch, s["dtype"]), device)
        fn = kernels.backends(item["op"])[item["backend"]]
        return cases.make_call(fn, held[key], item["options"], "fwd"), held[key]
    return call


def counters_pass(items: list[dict], settings: dict, device) -> None:
    """Run every item once between boundary markers: [set-up] M [call] M [set-up] M ..."""
    call_of = inputs(settings, device)
    for item in items:
        call = None
        try:
            call = call_of(item)[0]
            torch.cuda.synchronize()
            measure.mark_boundary()
            call()
        except Exception as e:  # noqa: BLE001 - an empty group keeps the alignment
            print(f"counters pass: {item['backend']} T={item['T']}: {type(e).__name__}: {e}", flush=True)
            if call is None:
                measure.mark_boundary()
        measure.mark_boundary()
    torch.cuda.synchronize()


def collect_counters(job, items: list[dict], env: dict, settings: dict) -> dict:
    """{config_id: counters or None}, cached beside the records for a resumed run."""
    ok, reason = measure.counters_available(env)
    if not settings.get("counters", False) or not ok:
        return {"_reason": reason if not ok else "counters not requested by the profile"}
    cache = Path(job.params["records_dir"]).parent / "counters.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    ids = [config_id(i, settings, "AB") for i in items]
    job_file = Path("results/.tmp/jobs/track_scan-counters.json")
    atomic.write_json(job_file, job.to_json())
    got = measure.ncu_counters([sys.executable, job.script, "--job", str(job_file)], len(ids),
                               timeout_s=settings.get("counters_timeout_s", 600), env={COUNTERS_PASS: "1"})
    # One pass serves both orders: the same kernels run whatever the order.
    out = {"_reason": "the Nsight Compute pass failed; counters left empty"} if got is None else \
        {**dict(zip(ids, got)), "_reason": "not profiled: a PyTorch per-step loop or associative scan"}
    atomic.write_json(cache, out)
    return out


def main(job):
    s, device, env = job.params["settings"], measure.device_of(), job.load("environment")
    items = plan(s, job.load("gates"))
    profiled = [i for i in items if i["backend"] not in COUNTERS_SKIP]
    if os.environ.get(COUNTERS_PASS):
        return counters_pass(profiled, s, device)
    bandwidth, counters = measure.copy_bandwidth(env), collect_counters(job, profiled, env, s)
    runner, call_of = measure.Runner.for_job(job, "scan", s, device), inputs(s, device)
    for T in s["T"]:
        for order, seq, item in measure.orders([i for i in items if i["T"] == T], s.get("orders", ["AB", "BA"])):
            slow, cid, op = s.get("slow", {}).get(item["backend"], {}), config_id(item, s, order), item["op"]

            def body(item=item, slow=slow, reuse=runner.twin(cid)):
                call, args = call_of(item)
                f = measure.measure(call, slow.get("reps", s["reps"]), slow.get("warmup", s["warmup"]), device,
                                    s.get("budget_s_per_config"), reuse)
                f["logical"] = {**f["logical"], "state_bytes": s["B"] * s["D"] * 4}
                return measure.floor_fields(f, floor_bytes(args, args[1] if item["op"] == "scan" else args[0]),
                                            bandwidth)

            counter = counters.get(config_id(item, s, "AB"))
            runner.run(cid, body, shapes={"B": s["B"], "T": T, "D": s["D"]}, mixer=op if op != "scan" else None,
                       backend=item["backend"], op=op, options=item["options"], peer=False, exact=item["exact"],
                       order=order, sequence=[i["backend"] + opt_tag(i["options"]) + "/" + i["op"] for i in seq],
                       dtype=s["dtype"], counters=counter, counters_reason=None if counter else counters.get("_reason"))
    runner.finish(job.output.records)


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
