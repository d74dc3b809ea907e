"""Training-step track -> results/tracks/train/records.jsonl: Hawk models that differ only in the mixer, one train_step
of 8192 tokens. Diagnostics (every gated backend), the comparison (each mixer's fastest exact backend, fresh runs, per
step mode), then the official peer and last the slow PyTorch reference, so that a spent budget cuts those first."""

from common import cases, measure, stage, training
from common.cases import chunk_variants, opt_tag
from common.training import Setup

import kernels

PEER = "peer:recurrentgemma"
LINEAR_COUNTS = ("launches", "accounted_launches", "bytes_read", "bytes_written", "memcpy", "memset")


def loop_counts(setup_at, lengths: list[int], T: int, device) -> dict:
    """One step's counts of a per-step PyTorch loop at length T, extrapolated from two short lengths
    (they are affine in T): profiling the full loop costs about 20 of its steps."""
    got = []
    for t in lengths:
        s = setup_at(t)
        try:
            s.step()
            got.append(measure.logical_counts(s.step, device))
        finally:
            del s
            measure.release(device)
    (t1, t2), (a, b) = lengths, got
    out = {k: v for k, v in b.items() if k not in ("top_kernels", "top_kernels_by_time", "by_kernel", "device_us")}
    out.update({k: round(a[k] + (b[k] - a[k]) * (T - t1) / (t2 - t1)) for k in LINEAR_COUNTS
                if all(isinstance(c.get(k), (int, float)) for c in got)})
    out["launches_method"] = (f"{b['launches_method']} at T = {t1} and {t2}, extrapolated linearly to T = {T} "
                              f"(a per-step loop)")
    out["counted_at_T"] = {str(t): {k: c.get(k) for k in LINEAR_COUNTS} for t, c in zip(lengths, got)}
    return out


def main(job):
    settings, device = job.params["settings"], measure.device_of()
    gates, inexact = job.load("gates"), settings.get("inexact", [])
    tuned = kernels.Backend("auto", table=kernels.TuningTable.load(job.input.table))
    matmul_rate, peak_rate = measure.matmul_rate(job.load("environment")), settings.get("peak_flop_per_s")
    runner = measure.Runner.for_job(job, "train", settings, device)
    mixers, diag = settings["mixers"], settings.get("diagnostics", "all")
    diag_orders = settings.get("diagnostic_orders", ["AB", "BA"])
    shapes = [(p, s["T"], s["B"]) for p in settings["presets"] for s in settings["shapes"]]
    diag_shapes = shapes if diag == "all" else [(d["preset"], d["T"], d["B"]) for d in diag]
    ref_lim, off = settings.get("reference", {}), settings.get("official", {})

    def measured(cid, preset, T, B, mixer, name, opts, reps, warmup, order=None, graph=False, **fields):
        """Time the step with backend `name` ("auto": the table, PEER: the official model), reusing the
        AB counts in BA; a per-step loop is counted at short lengths (loop_count_T)."""
        official, logical = name == PEER, runner.twin(cid)

        def make_at(t):
            backend = tuned if name == "auto" else "auto" if official else kernels.Backend(name, **opts)
            return Setup(preset, mixer, t, B, settings, device, backend=backend, official=official, graph=graph)

        def body(logical=logical):
            if official:
                cases.load_official()
            if name in ("reference", PEER) and logical is None and settings.get("loop_count_T"):
                logical = loop_counts(make_at, settings["loop_count_T"], T, device)
            s = make_at(T)
            try:
                if s.graph is not None and logical is None:
                    # a replay launches nothing from the host: count one eager step of the same model
                    logical = measure.logical_counts(s.eager_step, device)
                    logical["launches_method"] += " (one eager step: the graph replays its kernels)"
                fields = measure.measure(s.step, reps, warmup, device, settings.get("budget_s_per_config"), logical)
                fields.update(s.figures(fields, matmul_rate, peak_rate))
                return fields
            finally:
                del s
                measure.release(device)

        runner.run(cid, body, **training.identity(preset, T, B, mixer, settings), backend=name, options=opts,
                   order=order, **fields)

    # On a GPU the PyTorch per-step reference is the slow one; on the CPU it is what
    # the architecture comparison measures, so it runs first there.
    slow_names = {"reference"} if device.type == "cuda" else set()

    def diagnostics(slow: bool):
        """Every gated backend at every diagnostics shape: the slow PyTorch loops or the others."""
        items = []
        for mixer in mixers:
            fns = kernels.backends(mixer)
            for name in cases.diagnostic_backend_names(mixer, fns, gates)[0]:
                if (name in slow_names) == slow and (not settings.get("backends") or name in settings["backends"]):
                    opts = chunk_variants(name, fns[name], settings["chunk_sizes"]) if device.type == "cuda" else [{}]
                    items += [(mixer, name, o) for o in opts]
        for preset, T, B in diag_shapes:
            # the official peer before the reference loop: a spent budget cuts the yardstick first
            if slow and "rglru" in mixers and preset in off.get("presets", []) and T <= off.get("max_T", 0):
                measured(f"train-peer-{preset}-T{T}-B{B}-rglru-official", preset, T, B, "rglru", PEER, {},
                         off.get("reps", 2), off.get("warmup", 1), role="peer", exact=True)
            for order, seq, (mixer, name, opts) in measure.orders(items, diag_orders):
                reps, warmup = settings["reps"], settings["warmup"]
                if name == "reference":
                    if T > ref_lim.get("max_T", 0) or preset not in ref_lim.get("presets", []):
                        continue
                    reps, warmup = ref_lim.get("reps", 1), ref_lim.get("warmup", 1)
                measured(f"train-diag-{preset}-T{T}-B{B}-{mixer}-{name}{opt_tag(opts)}-{order}", preset, T, B,
                         mixer, name, opts, reps, warmup, order, role="diagnostic",
                         exact=name in cases.exact_backend_names(mixer, [name], gates, inexact),
                         sequence=[f"{m}/{n}{opt_tag(o)}" for m, n, o in seq])

    diagnostics(slow=False)
    for preset, T, B in shapes:
        chosen = {}
        for mixer in mixers:
            recs = (runner.ok(rid) for rid in list(runner.done))
            cands = [r for r in recs if r and r.get("role") == "diagnostic" and r["mixer"] == mixer and r.get("exact")
                     and training.shape_of(r) == (preset, T, B)
                     and cases.exact_backend_names(mixer, [r["backend"]], gates, inexact)]
            if cands:
                best = min(cands, key=lambda r: r["stats"]["median_ms"])
                chosen[mixer] = (best["backend"], best.get("options") or {},
                                 sorted(r["config_id"] for r in cands), "fastest diagnostics record")
            else:
                chosen[mixer] = ("auto", {}, [], "tuning table (no diagnostics at this preset and shape)")
        for mode in settings.get("step_modes", ["eager"]):
            tag = "-graph" if mode == "graph" else ""
            for order, seq, mixer in measure.orders(mixers):
                name, opts, sel, why = chosen[mixer]
                measured(f"train-arch-{preset}-T{T}-B{B}-{mixer}-{name}{opt_tag(opts)}{tag}-{order}", preset, T, B,
                         mixer, name, opts, settings["fresh_reps"], settings["warmup"], order, graph=mode == "graph",
                         role="fresh", exact=True, selected_from=sel, selected_by=why, sequence=list(seq))
    diagnostics(slow=True)
    runner.finish(job.output.records)


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
