"""Section-4 scan track -> results/tracks/scan/records.jsonl.

Griffin section 4, Fig. 8a shape: B = 8 sequences of 1024 real states (RG-LRU
D = 1024; SAMU M = 512 complex modes = 1024 real values; the bare scan D = 1024),
T = 2048 .. 16384, forward only, timed after the projections (the ops receive
what the projections produce). Every backend of every op (chunked ones once per
chunk size of the profile) and, when installed, the peers on the bare scan: the
official recurrentgemma PyTorch scan, flash-linear-attention's HGRN scans and
accelerated-scan. The whole list runs in both orders (AB = listed order, BA =
reversed). Each record carries the memory floor: the bytes any implementation
must move (inputs read once, output written once) over the copy bandwidth the
probe measured in this run. Peers are checked against the reference first and
recorded as failed if they disagree. Hardware counters come from one Nsight
Compute pass when the probe found them readable, else stay null.
"""


import json
import os
import sys
from pathlib import Path

from common import atomic, cases, measure, stage
from common.cases import check_close, chunk_variants, floor_bytes, op_inputs, opt_tag

COUNTERS_PASS = "KERNELS_SCAN_COUNTERS_PASS"


def plan(settings: dict, gates: dict | None) -> list[dict]:
    """Every (op, backend, options, T) of the track in listed order, per T."""
    import kernels

    out = []
    for T in settings["T"]:
        for op in settings["ops"]:
            fns = kernels.backends(op)
            # Backends inexact by design (BF16 accumulation) run too, labelled exact=False.
            names, exact = cases.diagnostic_backend_names(op, fns, gates)
            for name in names:
                if settings.get("backends") and name not in settings["backends"]:
                    continue
                if name == "reference" and T > settings.get("reference_max_T", 0):
                    continue
                for opts in chunk_variants(name, fns[name], settings["chunk_sizes"]):
                    out.append({"T": T, "op": op, "backend": name, "options": opts, "peer": False,
                                "exact": name in exact})
        for peer in settings.get("peers", []):
            if T <= settings.get("peer_max_T", {}).get(peer, T):
                out.append({"T": T, "op": "scan", "backend": f"peer:{peer}", "options": {}, "peer": True,
                            "exact": None})
    return out


def config_id(item: dict, settings: dict, order: str) -> str:
    name = item["backend"].replace(":", "-")
    return (f"scan-{item['op']}-{name}{opt_tag(item['options'])}-B{settings['B']}-T{item['T']}"
            f"-D{settings['D']}-{settings['dtype']}-{order}")


class Inputs:
    """Inputs for one (op, T) at a time, built on first use, plus the reference
    scan output the peers are checked against."""

    def __init__(self, settings, device):
        self.settings, self.device = settings, device
        self.key, self.args, self.ref = None, None, None

    def get(self, op, T):
        import torch

        if self.key != (op, T):
            self.args = self.ref = None
            measure.release(self.device)
            s = self.settings
            self.args = op_inputs(op, s["B"], T, s["D"], getattr(torch, s["dtype"]), self.device)
            self.key = (op, T)
        return self.args

    def reference(self):
        import kernels

        if self.ref is None:
            self.ref = kernels.backends("scan")["reference"](*self.args)[0]
        return self.ref


def forward_fn(item: dict, inputs: Inputs, check_tol: float | None):
    """(fn, args) for one item: the timed no-grad forward call (a peer is first
    checked against the reference unless check_tol is None)."""
    import torch

    import kernels

    args = inputs.get(item["op"], item["T"])
    if item["peer"]:
        peer = cases.Peer(item["backend"].split(":", 1)[1], args[0], args[1], args[2])
        if check_tol is not None:
            check_close(f"{item['backend']} output", peer.output(), inputs.reference(), check_tol)
        return peer.call, args
    f, opts = kernels.backends(item["op"])[item["backend"]], item["options"]

    def call():
        with torch.no_grad():
            return f(*args, **opts)[0]
    return call, args


def counter_items(items: list[dict], settings: dict) -> list[dict]:
    """Items profiled by Nsight Compute: not the PyTorch per-step loops or the PyTorch
    associative scans, whose many small kernels would each be replayed."""
    skip = settings.get("counters_skip", ["reference", "peer:recurrentgemma", "assoc", "assoc_bf16"])
    return [i for i in items if i["backend"] not in skip]


def counters_pass(items: list[dict], settings: dict, device) -> None:
    """Run every item once, bracketed by boundary markers so that set-up kernels
    (inputs) fall outside the groups: [set-up] M [call] M [set-up] M [call] M ..."""
    import torch

    inputs = Inputs(settings, device)
    for item in items:
        try:
            call, _ = forward_fn(item, inputs, None)
        except Exception as e:  # noqa: BLE001 - an empty group keeps the alignment
            print(f"counters pass: {item['backend']} T={item['T']}: {type(e).__name__}: {e}", flush=True)
            call = None
        torch.cuda.synchronize()
        measure.mark_boundary()
        if call is not None:
            try:
                call()
            except Exception as e:  # noqa: BLE001
                print(f"counters pass: {item['backend']} T={item['T']}: {type(e).__name__}: {e}", flush=True)
        measure.mark_boundary()
    torch.cuda.synchronize()


def collect_counters(job, items: list[dict], env: dict, settings: dict) -> dict:
    """{config_id: counters or None}; cached next to the records so a resumed run
    does not repeat the pass. Only when the probe found counters readable."""
    ok, reason = measure.counters_available(env)
    if not settings.get("counters", False) or not ok:
        return {"_reason": reason if not ok else "counters not requested by the profile"}
    cache = Path(job.params["records_dir"]).parent / "counters.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    ids = [config_id(i, settings, "AB") for i in counter_items(items, settings)]
    job_file = Path("results/.tmp/jobs/track_scan-counters.json")
    atomic.write_json(job_file, job.to_json())
    os.environ[COUNTERS_PASS] = "1"
    try:
        got = measure.ncu_counters([sys.executable, job.script, "--job", str(job_file)], len(ids),
                                   timeout_s=settings.get("counters_timeout_s", 600))
    finally:
        os.environ.pop(COUNTERS_PASS, None)
    if got is None:
        out = {"_reason": "the Nsight Compute pass failed; counters left empty"}
    else:
        # One pass serves both orders: the same kernels run whatever the order.
        out = {cid: c for cid, c in zip(ids, got)}
        out["_reason"] = "not profiled: a PyTorch per-step loop (thousands of kernels)"
    atomic.write_json(cache, out)
    return out


def main(job):
    import torch

    settings = job.params["settings"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gates = json.loads(Path(job.input.gates).read_text())
    env = json.loads(Path(job.input.environment).read_text())
    os.environ["KERNELS_TUNING_TABLE"] = str(Path(job.input.table).resolve())
    items = plan(settings, gates)
    if os.environ.get(COUNTERS_PASS):
        counters_pass(counter_items(items, settings), settings, device)
        return
    bandwidth = measure.copy_bandwidth(env)
    counters = collect_counters(job, items, env, settings)
    runner = measure.Runner("scan", job.profile, job.params["records_dir"], settings.get("budget_s"), device,
                            restart=lambda: measure.reexec(job), lock_clocks=job.lock_clocks)
    inputs = Inputs(settings, device)
    for T in settings["T"]:
        row = [i for i in items if i["T"] == T]
        for order, seq in measure.orders(row):
            if order not in settings.get("orders", ["AB", "BA"]):
                continue
            for item in seq:
                cid = config_id(item, settings, order)

                slow = settings.get("slow", {}).get(item["backend"], {})
                reps, warmup = slow.get("reps", settings["reps"]), slow.get("warmup", settings["warmup"])

                reuse = None if order == "AB" else runner.ok(config_id(item, settings, "AB"))

                def body(item=item, reps=reps, warmup=warmup, reuse=reuse):
                    call, args = forward_fn(item, inputs, settings["check_tolerance"])
                    logical = measure.reuse_logical(reuse)
                    m = measure.measure(call, reps, warmup, device, count=logical is None,
                                        budget_s=settings.get("budget_s_per_config"))
                    fields = measure.timing_fields(m)
                    fields["logical"] = fields["logical"] or logical
                    act = args[1] if item["op"] == "scan" else args[0]
                    fb = floor_bytes(args[:2] if item["peer"] else args, act)
                    floor_ms = fb / bandwidth * 1e3 if bandwidth else None
                    med = fields["stats"]["median_ms"]
                    fields.update(floor_bytes=fb, copy_bandwidth_bytes_per_s=bandwidth, floor_ms=floor_ms,
                                  fraction_of_floor=(floor_ms / med) if floor_ms else None)
                    fields["logical"]["state_bytes"] = settings["B"] * settings["D"] * 4
                    fields["logical"]["floor_bytes"] = fb
                    return fields

                counter = counters.get(config_id(item, settings, "AB"))
                runner.run(cid, body, shapes={"B": settings["B"], "T": T, "D": settings["D"]},
                           mixer=item["op"] if item["op"] != "scan" else None, backend=item["backend"],
                           op=item["op"], options=item["options"], peer=item["peer"], exact=item["exact"],
                           order=order,
                           sequence=[i["backend"] + opt_tag(i["options"]) + "/" + i["op"] for i in seq],
                           dtype=settings["dtype"], counters=counter,
                           counters_reason=None if counter else counters.get("_reason"))
    recs = runner.finish(job.output.records)
    print(f"track_scan: {len(recs)} records", flush=True)


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
