"""Ops track -> results/tracks/ops/records.jsonl (SPEC 5, track 0).

The ops as users call them (`backend="auto"`), beside their peers in the same
process, at the training shapes of the profile's presets (B, T, D = the preset's
RG-LRU width, with resets):
- `scan`: kernels.scan against accelerated-scan (Triton; warp where it compiles)
  and flash-linear-attention's fused recurrent HGRN (resets as sequence bounds);
- `rglru`: kernels.rglru from gate logits;
- `rglru_layer`: our RG-LRU layer (gates + op) against the official recurrentgemma
  torch layer with the same weights;
- `samu`: kernels.samu;
forward ("fwd", no autograd) and forward + backward to every input ("fwd_bwd");
and the decode steps `rglru_step` (against the official layer at T = 1) and
`samu_step` at the profile's batch sizes. Each case runs its variants in both
orders. Every variant is gated first, at the real shape: output (and gradients)
against the float64 reference within the profile's tolerance; a failed gate is a
failed record without timings. Each record carries the harness's clocks (device
and eager), the SM clock and the memory floor: logical bytes (cases.floor_bytes)
over the probe's copy bandwidth.

    python workflow/scripts/track_ops.py --standalone --profile h200 --out DIR

runs the track outside Snakemake (it measures the copy bandwidth itself).
"""


import argparse
import json
import sys
from pathlib import Path

from common import cases, measure, stage


class Case:
    """One comparison: `variants` maps a variant name to a function that builds
    (call, gate) -- the timed no-argument call and a gate that returns
    {check: max relative error} or raises -- plus the floor's byte count."""

    def __init__(self, name: str, shapes: dict, mode: str, variants: dict, floor: int):
        self.name, self.shapes, self.mode, self.variants, self.floor = name, shapes, mode, variants, floor

    def tag(self) -> str:
        s = self.shapes
        dims = f"B{s['B']}-D{s['D']}" + (f"-T{s['T']}" if "T" in s else "")
        return f"ops-{self.name}-{s.get('preset', 'step')}-{dims}-{self.mode}"


def _double(args: list, grad: bool) -> list:
    import torch

    return [a.detach().double().requires_grad_(grad) if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a for a in args]


def op_case(op: str, preset: str, D: int, mode: str, s: dict, device, dtype, tol: float) -> Case:
    """kernels.<op> (and for scan its peers) against the float64 reference."""
    import torch

    import kernels

    grad = mode == "fwd_bwd"
    B, T = s["B"], s["T"]
    args = cases.op_inputs(op, B, T, D, dtype, device, requires_grad=grad, resets=s.get("resets", True))
    fn = getattr(kernels, op)
    ref = _double(args, grad)
    y_ref = fn(*ref, backend="reference")[0]
    grad_out = torch.randn(B, T, D, device=device, dtype=dtype) if grad else None
    if grad and op == "samu":
        grad_out = grad_out.masked_fill(cases.samu_kinks(args), 0)
    g_ref = torch.autograd.grad(y_ref, cases.grad_targets(ref), grad_out.double()) if grad else ()
    y_ref = y_ref.detach()

    def ours():
        call = cases.make_call(fn, args, {}, mode, grad_out)

        def gate():
            errs = {"output": cases.check_close("output", cases.make_call(fn, args, {}, "fwd")(), y_ref, tol)}
            for i, (got, want) in enumerate(zip(call() if grad else (), g_ref)):
                errs[f"grad{i}"] = cases.check_close(f"gradient {i}", got, want, tol)
            return errs
        return call, gate

    def peer(name):
        def build():
            p = cases.Peer(name, args[0], args[1], args[2], grad)
            if grad:
                p.set_grad_out(grad_out)

            def gate():
                errs = {"output": cases.check_close("output", p.output(), y_ref, tol)}
                if grad:
                    reset = (args[2] == 0)[..., None]
                    ga, gb = p.grads()
                    errs["grad_a"] = cases.check_close("gradient of a", ga, g_ref[0].masked_fill(reset, 0), tol)
                    errs["grad_b"] = cases.check_close("gradient of b", gb, g_ref[1], tol)
                return errs
            return p.call, gate
        return build

    variants = {"ours": ours}
    if op == "scan":
        variants.update({f"peer:{p}": peer(p) for p in s.get("scan_peers", [])})
    shapes = {"preset": preset, "B": B, "T": T, "D": D, "resets": s.get("resets", True)}
    return Case(op, shapes, mode, variants, cases.floor_bytes(args[:2] if op == "scan" else args, y_ref.to(dtype), mode))


def layer_case(preset: str, D: int, heads: int, mode: str, s: dict, device, dtype, tol: float) -> Case:
    """Our RG-LRU layer against the official one (same weights, rounded to `dtype`),
    both against our layer's float64 reference run."""
    import torch

    grad = mode == "fwd_bwd"
    B, T = s["B"], s["T"]
    official, ours, ref = cases.official_rglru(D, heads, dtype, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(B, T, D, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)
    pos = cases.positions(B, T, device, s.get("resets", True))
    grad_out = torch.randn(B, T, D, generator=g).to(device=device, dtype=dtype) if grad else None
    x64 = x.detach().double().requires_grad_(grad)
    y_ref = ref(x64, pos)[0]
    g_ref = torch.autograd.grad(y_ref, [x64, *ref.parameters()], grad_out.double()) if grad else ()

    def variant(m):
        def build():
            targets = [x, *m.parameters()]

            def call():
                if not grad:
                    with torch.no_grad():
                        return m(x, pos)[0]
                return torch.autograd.grad(m(x, pos)[0], targets, grad_out)

            def gate():
                with torch.no_grad():
                    errs = {"output": cases.check_close("output", m(x, pos)[0], y_ref, tol)}
                names = ["x", *(n for n, _ in m.named_parameters())]
                for n, got, want in zip(names, call() if grad else (), g_ref):
                    errs[f"grad_{n}"] = cases.check_close(f"gradient of {n}", got, want, tol)
                return errs
            return call, gate
        return build

    shapes = {"preset": preset, "B": B, "T": T, "D": D, "heads": heads, "resets": s.get("resets", True)}
    floor = cases.floor_bytes([x, *ours.parameters()], y_ref.to(dtype), mode)
    return Case("rglru_layer", shapes, mode, {"ours": variant(ours), "peer:recurrentgemma": variant(official)}, floor)


def step_case(op: str, B: int, D: int, heads: int, s: dict, device, dtype, tol: float) -> Case:
    """kernels.<op>_step (and for RG-LRU the official layer at T = 1 from a cache)
    after 4 steps from a zero state against the float64 reference steps."""
    import torch

    import kernels

    fn = getattr(kernels, f"{op}_step")
    args, state0 = cases.step_inputs(op, B, D, heads, dtype, device)
    ref_args, ref_state = _double(args, False), state0.to(torch.complex128 if state0.is_complex() else torch.float64)
    for _ in range(4):
        y_ref = fn(*ref_args, ref_state, None, backend="reference")

    def ours():
        state = state0.clone()

        def gate():
            st = state0.clone()
            for _ in range(4):
                y = fn(*args, st, None)
            return {"output": cases.check_close("output after 4 steps", y, y_ref, tol),
                    "state": cases.check_close("state after 4 steps", st, ref_state, tol)}
        return (lambda: fn(*args, state, None)), gate

    def official():
        m, _, _ = cases.official_rglru(D, heads, dtype, device)
        with torch.no_grad():
            m.input_gate.w.copy_(args[1]), m.input_gate.b.copy_(args[2])
            m.a_gate.w.copy_(args[3]), m.a_gate.b.copy_(args[4]), m.a_param.copy_(args[5])
        x, pos, h0 = args[0][:, None], torch.ones(B, 1, dtype=torch.int64, device=device), state0.clone()

        def call():
            with torch.no_grad():
                return m(x, pos, h0)[0]

        def gate():
            h = state0.clone()
            with torch.no_grad():
                for _ in range(4):
                    y, h = m(x, pos, h)
            return {"output": cases.check_close("output after 4 steps", y[:, 0], y_ref, tol),
                    "state": cases.check_close("state after 4 steps", h, ref_state, tol)}
        return call, gate

    variants = {"ours": ours}
    if op == "rglru" and "recurrentgemma" in s.get("step_peers", []):
        variants["peer:recurrentgemma"] = official
    floor = cases.floor_bytes(args, y_ref.to(dtype)) + 2 * cases.nbytes([state0])
    return Case(f"{op}_step", {"B": B, "D": D, "heads": heads}, "step", variants, floor)


def plan(s: dict, device):
    """Case builders in running order (built one at a time: inputs are freed between)."""
    import torch

    from kernels.models import HawkConfig

    dtype, tol = getattr(torch, s["dtype"]), s["check_tolerance"]
    out = []
    for preset in s["presets"]:
        cfg = HawkConfig.preset(preset)
        for mode in s["modes"]:
            for op in s["ops"]:
                if op == "rglru_layer":
                    out.append(lambda p=preset, c=cfg, m=mode: layer_case(p, c.lru_width, c.num_heads, m, s, device,
                                                                          dtype, tol))
                else:
                    out.append(lambda o=op, p=preset, c=cfg, m=mode: op_case(o, p, c.lru_width, m, s, device, dtype, tol))
    dec = s.get("decode") or {}
    if dec:
        cfg = HawkConfig.preset(dec["preset"])
        for op in dec["ops"]:
            for B in dec["batches"]:
                out.append(lambda o=op, b=B: step_case(o, b, cfg.lru_width, cfg.num_heads, {**s, **dec}, device,
                                                       dtype, tol))
    return out


def run_case(runner: measure.Runner, case: Case, s: dict, bandwidth: float | None, device) -> None:
    names = list(case.variants)
    for order, seq in measure.orders(names):
        for name in seq:
            cid = f"{case.tag()}-{name.replace(':', '-')}-{order}"
            reuse = runner.ok(f"{case.tag()}-{name.replace(':', '-')}-AB") if order == "BA" else None

            def body(name=name, reuse=reuse):
                call, gate = case.variants[name]()
                errs = gate()
                logical = measure.reuse_logical(reuse)
                m = measure.measure(call, s["reps"], s["warmup"], device, count=logical is None,
                                    budget_s=s.get("budget_s_per_config"))
                f = measure.timing_fields(m)
                f["logical"] = f["logical"] or logical
                f["logical"]["floor_bytes"] = case.floor
                floor_ms = case.floor / bandwidth * 1e3 if bandwidth else None
                f.update(gate={"passed": True, "max_rel_err": errs, "tolerance": s["check_tolerance"],
                               "against": "float64 reference"},
                         floor_bytes=case.floor, copy_bandwidth_bytes_per_s=bandwidth, floor_ms=floor_ms,
                         fraction_of_floor=floor_ms / f["stats"]["median_ms"] if floor_ms else None)
                return f

            # mixer stays null: the report's SAMU / RG-LRU ratios are the ops section's own.
            runner.run(cid, body, shapes=case.shapes, op=case.name, mixer=None,
                       backend="auto" if name == "ours" else name,
                       variant=name, peer=name != "ours", mode=case.mode, order=order, sequence=seq,
                       dtype=s["dtype"])


def track(settings: dict, profile: str, records_dir, out_jsonl, bandwidth: float | None, restart=None,
          lock_clocks: bool = False) -> list:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runner = measure.Runner("ops", profile, records_dir, settings.get("budget_s"), device, restart=restart,
                            lock_clocks=lock_clocks)
    for build in plan(settings, device):
        try:
            outcome = measure.capture(build, device)
        except measure.Skip as why:
            runner.say(f"a case does not apply here: {why}")
            continue
        if not outcome.ok:
            runner.say(f"a case could not be set up: {measure.error_text(outcome.error)[:300]}")
            continue
        run_case(runner, outcome.value, settings, bandwidth, device)
        del outcome
        measure.release(device)
    recs = runner.finish(out_jsonl)
    runner.say(f"{len(recs)} records")
    return recs


def main(job):
    env = json.loads(Path(job.input.environment).read_text())
    track(job.params["settings"], job.profile, job.params["records_dir"], job.output.records,
          measure.copy_bandwidth(env), restart=lambda: measure.reexec(job), lock_clocks=job.lock_clocks)


def standalone(argv) -> None:
    """The track outside Snakemake, with the profile's settings from config.yaml."""
    import yaml

    from common.facts import REPO_ROOT

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--standalone", action="store_true", required=True)
    ap.add_argument("--profile", required=True, help="a profile of config.yaml (h200, h800, cpu-smoke)")
    ap.add_argument("--out", required=True, help="folder for records.d/ and records.jsonl")
    args = ap.parse_args(argv)
    prof = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())["profiles"][args.profile]
    stage.prepare_process()
    import torch

    dev = measure.device_of()
    buf = torch.empty(prof["probe"]["copy_bytes"], dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    t = measure.time_fn(lambda: dst.copy_(buf), reps=prof["probe"]["reps"], warmup=3, device=dev)
    bandwidth = 2 * buf.numel() / (t["median_ms"] * 1e-3)
    del buf, dst
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (bytes read + written)", flush=True)
    out = Path(args.out)
    recs = track(prof["ops"], args.profile, out / "records.d", out / "records.jsonl", bandwidth)
    for r in recs:
        st, eg = r.get("stats") or {}, r.get("eager") or {}
        print(f"{r['config_id']:<72} {r['status']:<6} {st.get('median_ms', float('nan')):9.4f} ms "
              f"({r.get('clock')}; eager {eg.get('median_ms', float('nan')):.4f}; "
              f"floor x{r.get('fraction_of_floor') or float('nan'):.2f})" if r["status"] == "ok"
              else f"{r['config_id']:<72} {r['status']}: {r['error'][:150]}")


if __name__ == "__main__":
    if "--standalone" in sys.argv:
        standalone(sys.argv[1:])
    else:
        stage.run(main, globals().get("snakemake"))
