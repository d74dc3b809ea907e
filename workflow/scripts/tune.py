"""Kernel tuning -> results/tune/tuning.json (the table `backend="auto"` reads) and
results/tune/records.jsonl (every measurement behind it).

Per op (rglru, samu, scan) and shape of the profile: every exact candidate --
each backend of kernels.backends(op) (the reference only where the profile asks,
i.e. on the CPU) crossed with the launcher options it accepts (chunk size, block
size, warps: the provider's TUNING grid when it declares one, otherwise the
profile's option grid restricted to the launcher's keyword parameters) -- is
checked against the reference on the same inputs, then timed on probe runs; the
fastest by median wins and is re-measured on fresh runs, and the table entry
carries those fresh figures. Decode steps are tuned separately per op and batch
size: each candidate runs three 64-step trajectories (its output fed back as the
next input; on a GPU the 64 steps are one CUDA-graph replay, as in the inference
engine, so host launch overhead does not decide) and the median trajectory decides;
the winner gets fresh trajectories.
Table schema: kernels/ops/tuning.py (version 1), plus a "decode" list.
"""


import fnmatch
import importlib
import itertools
import json
import statistics

from common import atomic, cases, facts, measure, records, stage
from common.cases import OPS, STEP_OPS, check_close, floor_bytes, make_call, op_inputs, opt_tag, step_inputs


# ------------------------------------------------------------- candidates


def _provider_attr(op: str, name: str, table: str, attr: str):
    """`attr` of the provider module whose `table` (BACKENDS/STEPS) registers op/name."""
    from kernels import ops

    for mod_name in ops.PROVIDERS:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError:
            continue
        if name in getattr(mod, table, {}).get(op, {}):
            return getattr(mod, attr, {}).get(op, {}).get(name)
    return None


def option_grid(fn, name: str, grids: dict, declared: dict | None, fixed: set[str] = frozenset(),
                op: str | None = None) -> list[dict]:
    """Every combination of launcher options to try for backend `name` of `op`. A
    provider's declared grid wins; otherwise the profile's grid for "op/name", else
    for "name", else for "*" keeps the keys the launcher accepts: its named keyword
    parameters outside `fixed` (the reference signature), or any key when it takes
    **options (such a launcher validates them itself)."""
    if declared:
        space = {k: list(v) for k, v in declared.items()}
    else:
        grids = grids or {}
        grid = grids.get(f"{op}/{name}", grids.get(name, grids.get("*", {})))
        params, var_kw = cases.signature(fn)
        space = {k: list(v) for k, v in grid.items() if (k in params and k not in fixed) or (var_kw and k not in params)}
    keys = sorted(space)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(space[k] for k in keys))] or [{}]


def op_candidates(op: str, settings: dict, gates: dict | None, device) -> list[tuple[str, dict]]:
    import kernels

    fns = kernels.backends(op)
    names = list(fns)
    if device.type == "cuda" and not settings.get("include_reference", False):
        names = [n for n in names if n != "reference"]
    names = cases.exact_backend_names(op, names, gates, settings.get("inexact", []))
    if settings.get("backends"):
        names = [n for n in names if n in settings["backends"]]
    out = []
    for name in names:
        declared = _provider_attr(op, name, "BACKENDS", "TUNING")
        for opts in option_grid(fns[name], name, settings.get("options", {}), declared, op=op):
            out.append((name, opts))
    return out[: settings.get("max_candidates", len(out))]


_STEP_FIXED = {
    "rglru": {"x", "gate_x_w", "gate_x_b", "gate_a_w", "gate_a_b", "a_param", "state", "reset"},
    "samu": {"x", "phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log", "state", "reset"},
}


def step_candidates(op: str, settings: dict, device) -> list[tuple[str, dict]]:
    import kernels

    fns = kernels.step_backends(op)
    names = list(fns)
    if device.type == "cuda" and not settings.get("include_reference", False):
        names = [n for n in names if n != "reference"]
    names = [n for n in names if not any(fnmatch.fnmatch(n, p) for p in settings.get("inexact", []))]
    if settings.get("backends"):
        names = [n for n in names if n in settings["backends"]]
    out = []
    for name in names:
        declared = _provider_attr(op, name, "STEPS", "STEP_TUNING")
        for opts in option_grid(fns[name], name, settings.get("options", {}), declared, _STEP_FIXED[op], op=op):
            out.append((name, opts))
    return out


# ------------------------------------------------------------------ stage


def tune_ops(runner: measure.Runner, settings: dict, gates: dict | None, device, log) -> list[dict]:
    import torch

    import kernels

    dtype = getattr(torch, settings["dtype"])
    tol = settings["check_tolerance"][settings["dtype"]]
    entries = []
    for op in OPS:
        mode = settings.get("modes", {}).get(op, "fwd_bwd")
        for shape in settings.get("shapes", {}).get(op, []):
            B, T, D = shape["B"], shape["T"], shape["D"]
            tag = f"{op}-{settings['dtype']}-B{B}-T{T}-D{D}-{mode}"
            cands = op_candidates(op, settings, gates, device)
            args = op_inputs(op, B, T, D, dtype, device, requires_grad=(mode == "fwd_bwd"))
            grad_out = torch.randn(B, T, D, device=device, dtype=dtype) if mode == "fwd_bwd" else None
            kinks = None
            if op == "samu" and mode == "fwd_bwd":
                # The audit's rule (kernels.parity.samu_relu_kinks): gradients are compared
                # with the output cotangent zeroed where the exact pre-relu state is ~0, so
                # a state rounding to the other side of relu's kink in one run and not in
                # the other cannot decide exactness. The same cotangent is timed.
                kinks = cases.samu_kinks(args)
                grad_out = grad_out.masked_fill(kinks, 0)
            ref_box = {}

            def reference():
                if not ref_box:
                    ref_box["y"] = kernels.backends(op)["reference"](*args)[0].detach()
                    if mode == "fwd_bwd":
                        ref_box["g"] = make_call(kernels.backends(op)["reference"], args, {}, mode, grad_out)()
                return ref_box

            probes = {}
            for name, opts in cands:
                cid = f"tune-{tag}-{name}{opt_tag(opts)}-probe"
                fn = kernels.backends(op)[name]

                def body(fn=fn, opts=opts):
                    ref = reference()
                    y = fn(*args, **opts)[0]
                    check_close("output", y.detach(), ref["y"], tol)
                    if mode == "fwd_bwd":
                        for i, (got, want) in enumerate(zip(make_call(fn, args, opts, mode, grad_out)(), ref["g"])):
                            check_close(f"gradient {i}", got, want, tol)
                    m = measure.measure(make_call(fn, args, opts, mode, grad_out), settings["reps"],
                                        settings["warmup"], device, budget_s=settings.get("budget_s_per_config"))
                    fields = measure.timing_fields(m)
                    fields["logical"]["floor_bytes"] = floor_bytes(args, y, mode)
                    if kinks is not None:
                        fields["relu_kinks_masked"] = int(kinks.sum())
                    return fields

                rec = runner.run(cid, body, shapes=shape, mixer=op if op != "scan" else None, backend=name,
                                 op=op, options=opts, role="probe", mode=mode, dtype=settings["dtype"])
                if rec is not None and rec["status"] == "ok":
                    probes[(name, json.dumps(opts, sort_keys=True))] = rec
            if not probes:
                log(f"{tag}: no candidate finished; no table entry")
                continue
            (name, opts_s), best = min(probes.items(), key=lambda kv: kv[1]["stats"]["median_ms"])
            opts = json.loads(opts_s)
            fn = kernels.backends(op)[name]

            def fresh(fn=fn, opts=opts):
                m = measure.measure(make_call(fn, args, opts, mode, grad_out), settings["fresh_reps"],
                                    settings["warmup"], device, budget_s=settings.get("budget_s_per_config"))
                return measure.timing_fields(m)

            fid = f"tune-{tag}-{name}{opt_tag(opts)}-fresh"
            rec = runner.run(fid, fresh, shapes=shape, mixer=op if op != "scan" else None, backend=name, op=op,
                             options=opts, role="fresh", mode=mode, dtype=settings["dtype"],
                             selected_from=sorted(r["config_id"] for r in probes.values()))
            figures = rec["stats"] if rec is not None and rec["status"] == "ok" else None
            entry = {"op": op, "dtype": settings["dtype"], "B": B, "T": T, "D": D, "backend": name,
                     "chunk_size": opts.get("chunk_size"),
                     "options": {k: v for k, v in opts.items() if k != "chunk_size"},
                     "mode": mode, "probe_median_ms": best["stats"]["median_ms"],
                     "fresh": figures, "fresh_config_id": fid, "candidates": len(probes)}
            entries.append(entry)
            log(f"{tag}: {name}{opt_tag(opts)} (probe median {best['stats']['median_ms']:.4g} ms)")
    return entries


def decode_trajectories(step, x0, n_steps: int, count: int, device, graph: bool = False) -> list[float]:
    """Milliseconds of `count` trajectories of n_steps decode steps, each step's
    output fed back as the next input. With `graph` on a GPU the n_steps steps are
    captured once in a CUDA graph (after one eager call that compiles) and each
    trajectory is one replay, so the figure is the kernels' time and not the host's
    launch overhead (tens of microseconds per eager step against a few for the
    kernel); the inference engine runs its steps the same way."""
    import torch

    if graph and device.type == "cuda":
        xin = x0.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step(xin)
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x = xin
            for _ in range(n_steps):
                x = step(x)
        g.replay()
        return [measure.time_trajectory(lambda i: g.replay(), [1], device)["cumulative_ms"][-1]
                for _ in range(count)]
    out = []
    for _ in range(count):
        box = {"x": x0.clone()}

        def one(i):
            box["x"] = step(box["x"])

        out.append(measure.time_trajectory(one, [n_steps], device)["cumulative_ms"][-1])
    return out


def tune_decode(runner: measure.Runner, settings: dict, device, log) -> list[dict]:
    import torch

    import kernels

    dec = settings.get("decode") or {}
    if not dec:
        return []
    dtype = getattr(torch, dec.get("dtype", "bfloat16"))
    tol = settings["check_tolerance"][dec.get("dtype", "bfloat16")]
    D, heads, n_steps, n_traj = dec["D"], dec["heads"], dec["steps"], dec["trajectories"]
    graph = dec.get("cuda_graphs", True)
    entries = []
    for op in STEP_OPS:
        for B in dec["batches"]:
            tag = f"decode-{op}-{dec.get('dtype', 'bfloat16')}-B{B}-D{D}"
            args, state0 = step_inputs(op, B, D, heads, dtype, device)
            ref_fn = kernels.step_backends(op)["reference"]
            results = {}
            for name, opts in step_candidates(op, dec, device):
                fn = kernels.step_backends(op)[name]
                cid = f"tune-{tag}-{name}{opt_tag(opts)}-probe"

                def make_step(fn=fn, opts=opts):
                    state = state0.clone()

                    def step(x):
                        return fn(x, *args[1:], state, None, **opts)
                    return step

                def body(fn=fn, opts=opts, make_step=make_step):
                    ref_state, got_state = state0.clone(), state0.clone()
                    xr = xg = args[0]
                    for _ in range(4):
                        xr = ref_fn(xr, *args[1:], ref_state, None)
                        xg = fn(xg, *args[1:], got_state, None, **opts)
                    check_close("decode output after 4 steps", xg, xr, tol)
                    step = make_step()
                    for _ in range(max(dec.get("warmup", 2), 1)):
                        step(args[0])
                    logical = measure.logical_counts(lambda: step(args[0]), device)
                    logical["state_bytes"] = state0.numel() * state0.element_size()
                    traj = decode_trajectories(make_step(), args[0], n_steps, n_traj, device, graph)
                    return {"samples_ms": traj, "stats": measure.stats_of(traj), "logical": logical,
                            "steps_per_trajectory": n_steps, "cuda_graph": graph and device.type == "cuda"}

                rec = runner.run(cid, body, shapes={"B": B, "D": D, "heads": heads}, mixer=op, backend=name,
                                 op=f"{op}_step", options=opts, role="probe", dtype=dec.get("dtype", "bfloat16"))
                if rec is not None and rec["status"] == "ok":
                    results[(name, json.dumps(opts, sort_keys=True))] = rec
            if not results:
                log(f"{tag}: no step candidate finished")
                continue
            (name, opts_s), best = min(results.items(), key=lambda kv: kv[1]["stats"]["median_ms"])
            opts = json.loads(opts_s)
            fn = kernels.step_backends(op)[name]

            def fresh(fn=fn, opts=opts):
                state = state0.clone()

                def step(x):
                    return fn(x, *args[1:], state, None, **opts)
                step(args[0])
                traj = decode_trajectories(step, args[0], n_steps, n_traj, device, graph)
                return {"samples_ms": traj, "stats": measure.stats_of(traj), "steps_per_trajectory": n_steps,
                        "cuda_graph": graph and device.type == "cuda"}

            fid = f"tune-{tag}-{name}{opt_tag(opts)}-fresh"
            rec = runner.run(fid, fresh, shapes={"B": B, "D": D, "heads": heads}, mixer=op, backend=name,
                             op=f"{op}_step", options=opts, role="fresh", dtype=dec.get("dtype", "bfloat16"),
                             selected_from=sorted(r["config_id"] for r in results.values()))
            figures = rec["stats"] if rec is not None and rec["status"] == "ok" else None
            entries.append({"op": f"{op}_step", "dtype": dec.get("dtype", "bfloat16"), "B": B, "D": D,
                            "backend": name, "options": opts, "steps": n_steps,
                            "probe_median_trajectory_ms": statistics.median(best["samples_ms"]),
                            "fresh": figures, "fresh_config_id": fid, "candidates": len(results)})
            log(f"{tag}: {name}{opt_tag(opts)}")
    return entries


def table_document(profile: str, entries: list[dict], decode: list[dict], device) -> dict:
    gpu = facts.gpu()
    return {"schema": 1, "profile": profile, "gpu": gpu["name"] if gpu else None, "device": device.type,
            "commit": facts.commit(), "versions": facts.versions(), "timestamp": records.now(),
            "entries": entries, "decode": decode}


def main(job):
    import torch

    from kernels.ops import tuning

    settings = job.params["settings"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gates = json.loads(open(job.input.gates).read())
    records_dir = job.params.get("records_dir", "results/tune/records.d")
    runner = measure.Runner("tune", job.profile, records_dir, settings.get("budget_s"), device,
                            restart=lambda: measure.reexec(job), lock_clocks=job.lock_clocks)

    def log(msg):
        measure.log_line(None, f"tune: {msg}")

    entries = tune_ops(runner, settings, gates, device, log)
    decode = tune_decode(runner, settings, device, log)
    doc = table_document(job.profile, entries, decode, device)
    tuning.validate_table(doc)
    runner.finish(job.output.records)
    atomic.write_json(job.output.table, doc)
    log(f"{len(entries)} op entries, {len(decode)} decode entries -> {job.output.table}")


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
