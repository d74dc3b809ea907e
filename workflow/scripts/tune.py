"""Kernel tuning -> results/tune/tuning.json (what `backend="auto"` reads) and records.jsonl: per op
and shape every exact candidate is checked and probed, the fastest re-measured on fresh runs;
decode steps per batch size and the decode linears role by role likewise, as trajectories."""

import itertools
import math
import statistics

import torch

from common import atomic, cases, facts, measure, records, stage
from common.cases import OPS, STEP_OPS, checked, floor_bytes, make_call, op_inputs, opt_tag, rel_err, step_inputs

import kernels
from kernels.models import HawkConfig, HawkLM
from kernels.models import decode as dk
from kernels.models.generation import LINEAR_ROLES, Engine
from kernels.ops import tuning


def candidates(op: str, fns: dict, settings: dict, device, gates=None, fixed=frozenset()) -> list[tuple[str, dict]]:
    """(backend, options) pairs to try among the backends in `fns` that pass the audit (`gates`, where
    given) and match no `inexact` pattern (cases.exact_backend_names)."""
    names = [n for n in cases.exact_backend_names(op, fns, gates, settings.get("inexact", []))
             if (n != "reference" or device.type != "cuda" or settings.get("include_reference", False))
             and (not settings.get("backends") or n in settings["backends"])]
    return [(n, o) for n in names for o in cases.option_grid(fns[n], n, settings.get("options", {}), fixed, op)]


def select(runner: measure.Runner, tag: str, cands, probe, fresh, fields: dict) -> dict | None:
    """Probe every candidate, re-measure the fastest on fresh runs; the entry's common part or None."""
    probes = []
    for name, opts in cands:
        rec = runner.run(f"tune-{tag}-{name}{opt_tag(opts)}-probe", lambda n=name, o=opts: probe(n, o), **fields,
                         backend=name, options=opts, role="probe")
        if rec is not None and rec["status"] == "ok":
            probes.append((name, opts, rec))
    if not probes:
        runner.say(f"{tag}: no candidate finished; no table entry")
        return None
    name, opts, best = min(probes, key=lambda p: p[2]["stats"]["median_ms"])
    fid = f"tune-{tag}-{name}{opt_tag(opts)}-fresh"
    rec = runner.run(fid, lambda: fresh(name, opts), **fields, backend=name, options=opts, role="fresh",
                     selected_from=sorted(r["config_id"] for *_, r in probes))
    runner.say(f"{tag}: {name}{opt_tag(opts)} (probe median {best['stats']['median_ms']:.4g} ms)")
    return {"backend": name, "options": opts, "best": best, "fresh_config_id": fid, "candidates": len(probes),
            "fresh": rec["stats"] if rec is not None and rec["status"] == "ok" else None}


def tune_ops(runner: measure.Runner, settings: dict, gates: dict | None, device) -> list[dict]:
    dt_name = settings["dtype"]
    dtype, tol = getattr(torch, dt_name), settings["check_tolerance"][dt_name]
    entries = []
    for op in OPS:
        mode = settings.get("modes", {}).get(op, "fwd_bwd")
        grad, fns = mode == "fwd_bwd", kernels.backends(op)
        for shape in settings.get("shapes", {}).get(op, []):
            B, T, D = shape["B"], shape["T"], shape["D"]
            args = op_inputs(op, B, T, D, dtype, device, requires_grad=grad)
            grad_out = torch.randn(B, T, D, device=device, dtype=dtype) if grad else None
            # The audit's rule (cases.samu_kinks); the same cotangent is timed.
            kinks = cases.samu_kinks(args) if op == "samu" and grad else None
            if kinks is not None:
                grad_out = grad_out.masked_fill(kinks, 0)
            ref = {}

            def timed(name, opts, reps):
                return measure.measure(make_call(fns[name], args, opts, mode, grad_out), reps, settings["warmup"],
                                       device, budget_s=settings.get("budget_s_per_config"))

            def probe(name, opts):
                if not ref:
                    ref["y"] = fns["reference"](*args)[0].detach()
                    ref["g"] = make_call(fns["reference"], args, {}, mode, grad_out)() if grad else ()
                y = fns[name](*args, **opts)[0]
                checked({"output": rel_err(y.detach(), ref["y"])}, tol)
                if grad:
                    grads = make_call(fns[name], args, opts, mode, grad_out)()
                    checked({f"gradient {i}": rel_err(g, w) for i, (g, w) in enumerate(zip(grads, ref["g"]))}, tol)
                f = timed(name, opts, settings["reps"])
                f["logical"]["floor_bytes"] = floor_bytes(args, y, mode)
                if kinks is not None:
                    f["relu_kinks_masked"] = int(kinks.sum())
                return f

            got = select(runner, f"{op}-{dt_name}-B{B}-T{T}-D{D}-{mode}",
                         candidates(op, fns, settings, device, gates)[: settings.get("max_candidates")],
                         probe, lambda n, o: timed(n, o, settings["fresh_reps"]),
                         {"shapes": shape, "mixer": op if op != "scan" else None, "op": op, "mode": mode,
                          "dtype": dt_name})
            if got is not None:
                opts = got.pop("options")
                entries.append({"op": op, "dtype": dt_name, "B": B, "T": T, "D": D,
                                "chunk_size": opts.get("chunk_size"),
                                "options": {k: v for k, v in opts.items() if k != "chunk_size"}, "mode": mode,
                                "probe_median_ms": got.pop("best")["stats"]["median_ms"], **got})
    return entries


def decode_trajectories(step, x0, n_steps: int, count: int, device, graph: bool) -> list[float]:
    """Milliseconds of `count` trajectories of n_steps fed-back decode steps (with `graph`, one
    replay of the captured steps each, as in the inference engine)."""
    if graph:
        xin = x0.clone()

        def steps():
            x = xin
            for _ in range(n_steps):
                x = step(x)
        g = measure.cuda_graph(lambda: step(xin), steps, device)
        g.replay()
        run, checkpoint, before = (lambda i: g.replay()), 1, None
    else:
        box = {}

        def run(i):
            box["x"] = step(box["x"])
        checkpoint, before = n_steps, lambda: box.update(x=x0.clone())
    return [measure.time_trajectory(run, [checkpoint], device, before=before)["cumulative_ms"][-1]
            for _ in range(count)]


def l2_bytes(device) -> int:
    """The device's L2 cache in bytes (0 off CUDA)."""
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0


def tune_decode(runner: measure.Runner, settings: dict, device) -> list[dict]:
    """Every decode step candidate per batch size, gated on 4 steps against the reference, timed as trajectories whose
    steps walk `layers` distinct layers as the model's step does. Successive steps take their layers from a pool of at
    least twice the L2 cache, so every visit finds a layer's weights, mode table and state evicted, as in the model
    (where its other weights stream between two visits of a layer), not in the cache that one walk would keep warm."""
    if not (dec := settings.get("decode")):
        return []
    dt_name = dec.get("dtype", "bfloat16")
    dtype, tol = getattr(torch, dt_name), settings["check_tolerance"][dt_name]
    D, heads, n_steps, n_traj, L = dec["D"], dec["heads"], dec["steps"], dec["trajectories"], dec.get("layers", 1)
    graph = dec.get("cuda_graphs", True) and device.type == "cuda"
    l2, entries = l2_bytes(device), []
    for op in STEP_OPS:
        fns = kernels.step_backends(op)
        for B in dec["batches"]:
            layers = [step_inputs(op, B, D, heads, dtype, device, seed=i) for i in range(L)]
            x0 = layers[0][0][0]
            walks = min(n_steps, math.ceil(2 * l2 / (L * measure.tensor_bytes(layers[0])))) if l2 else 1
            layers += [step_inputs(op, B, D, heads, dtype, device, seed=i) for i in range(L, L * walks)]
            # SAMU's steps read the mode table the generation engine computes once per batch
            tables = [{"modes": kernels.ops.samu_mode_table(a[5], a[6], dtype)} if op == "samu" and len(fns) > 1
                      else {} for a, _ in layers]

            def make_step(name, opts, n_layers=None):
                walk = [(a[1:], s.clone(), {**opts, **(t if name != "reference" else {})})
                        for (a, s), t in zip(layers[:n_layers], tables)]
                turns = itertools.cycle([walk[i:i + L] for i in range(0, len(walk), L)])

                def step(x):
                    for params, state, kw in next(turns):
                        x = fns[name](x, *params, state, None, **kw)
                    return x
                return step

            def trajectories(name, opts):
                step = make_step(name, opts)
                for _ in range(max(dec.get("warmup", 2), 1)):
                    step(x0)
                traj = decode_trajectories(make_step(name, opts), x0, n_steps, n_traj, device, graph)
                return {"samples_ms": traj, "stats": measure.summarize(traj), "steps_per_trajectory": n_steps,
                        "layers_per_step": L, "layer_pool": len(layers), "cuda_graph": graph}

            def probe(name, opts):
                ref, got = make_step("reference", {}, 1), make_step(name, opts, 1)
                xr = xg = x0
                for _ in range(4):
                    xr, xg = ref(xr), got(xg)
                checked({"decode output after 4 steps": rel_err(xg, xr)}, tol)
                f, one = trajectories(name, opts), make_step(name, opts, 1)
                logical = measure.logical_counts(lambda: one(x0), device)
                return {**f, "logical": {**logical, "state_bytes": measure.tensor_bytes(layers[0][1])}}

            got = select(runner, f"decode-{op}-{dt_name}-B{B}-D{D}",
                         candidates(op, fns, dec, device, fixed=cases.STEP_FIXED[op]), probe, trajectories,
                         {"shapes": {"B": B, "D": D, "heads": heads, "layers": L}, "mixer": op, "op": f"{op}_step",
                          "dtype": dt_name})
            if got is not None:
                entries.append({"op": f"{op}_step", "dtype": dt_name, "B": B, "D": D, "steps": n_steps, "layers": L,
                                "layer_pool": len(layers),
                                "probe_median_trajectory_ms": statistics.median(got.pop("best")["samples_ms"]), **got})
    return entries


def tune_linears(runner: measure.Runner, settings: dict, device) -> list[dict]:
    """Tiles of the weight-streaming linears, one role at a time (earlier roles at their choices):
    the grid beside the default, then the winner with each `refine` combination; each gated
    on the default tiles' first step from BOS, timed as trajectories of whole engine steps."""
    if not (lin := settings.get("linears")):
        return []
    dt_name = lin.get("dtype", "bfloat16")
    B, steps, n_traj, tol = lin["batch"], lin["steps"], lin["trajectories"], settings["check_tolerance"][dt_name]
    torch.manual_seed(0)
    cfg = HawkConfig.preset(lin["preset"], mixer="rglru", **({"vocab_size": lin["vocab"]} if "vocab" in lin else {}))
    model = HawkLM(cfg, device=device, dtype=getattr(torch, dt_name)).eval().requires_grad_(False)
    graph = lin.get("cuda_graphs", True) and device.type == "cuda"
    rows = dk.rows_block(B)

    def engine(configs):
        return Engine(model, kernels="gemm", graphs=graph, linear_configs=configs)

    def first_step(eng):
        eng.start(batch_size=B)
        return eng.step().clone(), [t.clone() for c in eng.cache.layers for t in (c.conv_state, c.rnn_state)]

    def trajectories(eng):
        traj = [measure.time_trajectory(lambda i: eng.step(), [steps], device, before=lambda: eng.start(batch_size=B),
                                        warmup=lin.get("warmup", 2) if k == 0 else 0)["cumulative_ms"][-1]
                for k in range(n_traj)]
        return {"samples_ms": traj, "stats": measure.summarize(traj), "steps_per_trajectory": steps,
                "cuda_graph": graph}

    want = first_step(engine({}))
    options = [{}] + cases.combos(lin.get("options", {}))
    refine = cases.combos(lin["refine"]) if lin.get("refine") else []
    chosen, entries = {}, []
    for role in LINEAR_ROLES:
        def with_role(opts, role=role):
            return {**chosen, role: opts} if opts else dict(chosen)

        def probe(name, opts):
            configs = with_role(opts)
            eng = engine(configs)
            tokens, states = first_step(eng)
            if not torch.equal(tokens, want[0]):
                raise ValueError(f"{role} tiles {opts}: first-step tokens differ from the default tiles'")
            checked({f"state {i}": rel_err(g, w) for i, (g, w) in enumerate(zip(states, want[1]))}, tol)
            return {**trajectories(eng), "logical": cases.step_counts(eng, B, device), "linear_configs": configs}

        def pick(suffix, tiles):
            return select(runner, f"linear-{role}-{lin['preset']}-{dt_name}-B{B}{suffix}",
                          [("gemm", o) for o in tiles], probe, lambda n, o: trajectories(engine(with_role(o))),
                          {"shapes": {"preset": lin["preset"], "B": B, "rows": rows}, "op": f"decode_linear_{role}",
                           "dtype": dt_name})

        if (got := pick("", options)) is None:
            continue
        if refine:      # the pipeline's depth around the winner: its tiles with each refine combination
            n_first = got["candidates"]
            got = pick("-refine", [got["options"]] + [{**got["options"], **r} for r in refine]) or got
            got["candidates"] += n_first
        if got["options"]:
            chosen[role] = got["options"]
        entries.append({"role": role, "dtype": dt_name, "rows": rows, "config": got.pop("options"), "B": B,
                        "preset": lin["preset"],
                        "probe_median_trajectory_ms": statistics.median(got.pop("best")["samples_ms"]), **got})
    return entries


def main(job):
    settings, device = job.params["settings"], measure.device_of()
    runner = measure.Runner.for_job(job, "tune", settings, device)
    entries, decode = tune_ops(runner, settings, job.load("gates"), device), tune_decode(runner, settings, device)
    try:
        linears, linears_error = tune_linears(runner, settings, device), None
    except Exception as e:  # noqa: BLE001 - the table keeps the op and step entries; the report names the error
        linears, linears_error = [], measure.error_text(measure.describe(e))
        runner.say(f"decode linears not tuned (the built-in tiles stay): {linears_error}")
    gpu = facts.gpu()
    doc = {"schema": 1, "profile": job.profile, "gpu": gpu["name"] if gpu else None, "device": device.type,
           "commit": facts.commit(), "versions": facts.versions(), "timestamp": records.now(),
           "entries": entries, "decode": decode, "decode_linears": linears,
           **({"decode_linears_error": linears_error} if linears_error else {})}
    tuning.validate_table(doc)
    runner.finish(job.output.records)
    atomic.write_json(job.output.table, doc)
    runner.say(f"{len(entries)} op entries, {len(decode)} decode entries, {len(linears)} decode linear entries "
               f"-> {job.output.table}")


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
