"""Ops track -> results/tracks/ops/records.jsonl: the ops as users call them
(`backend="auto"`) beside their peers, both orders, each variant first gated against
float64 (a peer in FP32 within PEER_GATE_TOL); a failed gate is a failed record."""

import copy
from functools import partial

import torch

from common import cases, measure, stage

import kernels
from kernels.models import HawkConfig

PEER_GATE_DTYPE, PEER_GATE_TOL = "float32", 1e-4
# Calls of each short configuration profiled on the host after its clocks (eager.host_profile,
# after measure.host_waits): where the eager time over the device time goes, ours and the peers alike.
HOST_PROFILE_CALLS = 100


class Case:
    """One comparison: `variants` maps a name to `make(dtype)` -> (timed call, errors()); `floor`: bytes."""

    def __init__(self, name: str, shapes: dict, mode: str, variants: dict, floor: int):
        self.name, self.shapes, self.mode, self.variants, self.floor = name, shapes, mode, variants, floor

    def tag(self) -> str:
        s = self.shapes
        dims = f"B{s['B']}-D{s['D']}" + (f"-T{s['T']}" if "T" in s else "")
        return f"ops-{self.name}-{s.get('preset', 'step')}-{dims}-{self.mode}"


def cast(args: list, dtype, grad: bool = False) -> list:
    """Fresh leaves of the floating-point tensors among `args` in `dtype`."""
    return [a.detach().to(dtype).requires_grad_(grad) if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a for a in args]


def grad_errors(forward, y_ref, backward, g_ref, names=None) -> dict:
    """{check: max relative error} of forward() against y_ref and of backward()'s gradients against g_ref."""
    names = names or [f"grad{i}" for i in range(len(g_ref))]
    return {"output": cases.rel_err(forward(), y_ref),
            **{n: cases.rel_err(got, want) for n, got, want in zip(names, backward() if g_ref else (), g_ref)}}


@torch.no_grad()
def step_errors(step, state0, y_ref, ref_state) -> dict:
    """Errors of the output and the state after 4 steps from state0: step(state) -> (y, state)."""
    state = state0.clone()
    for _ in range(4):
        y, state = step(state)
    # the official layer's output is [B, 1, D]
    return {"output": cases.rel_err(y.reshape(y_ref.shape), y_ref), "state": cases.rel_err(state, ref_state)}


def op_case(op: str, preset: str, D: int, mode: str, s: dict, device, dtype) -> Case:
    """kernels.<op> (and for scan its peers) against the float64 reference."""
    grad, B, T, resets = mode == "fwd_bwd", s["B"], s["T"], s.get("resets", True)
    args = cases.op_inputs(op, B, T, D, dtype, device, requires_grad=grad, resets=resets)
    fn, ref = getattr(kernels, op), cast(args, torch.float64, grad)
    y_ref = fn(*ref, backend="reference")[0]
    grad_out = torch.randn(B, T, D, device=device, dtype=dtype) if grad else None
    if grad and op == "samu":
        grad_out = grad_out.masked_fill(cases.samu_kinks(args), 0)
    g_ref = torch.autograd.grad(y_ref, cases.grad_targets(ref), grad_out.double()) if grad else ()
    y_ref = y_ref.detach()

    def inputs(dt):
        return (args, grad_out) if dt == dtype else (cast(args, dt, grad), grad_out.to(dt) if grad else None)

    def ours(dt):
        a, go = inputs(dt)
        call = cases.make_call(fn, a, {}, mode, go)
        return call, partial(grad_errors, cases.make_call(fn, a, {}, "fwd"), y_ref, call, g_ref)

    def peer(name, dt):
        a, go = inputs(dt)
        p = cases.Peer(name, a[0], a[1], a[2], grad)
        if grad:
            p.set_grad_out(go)
        want = (g_ref[0].masked_fill((args[2] == 0)[..., None], 0), g_ref[1]) if grad else ()
        return p.call, partial(grad_errors, p.output, y_ref, p.grads, want, ["grad_a", "grad_b"])

    variants = {"ours": ours}
    if op == "scan":
        variants.update({f"peer:{p}": partial(peer, p) for p in s.get("scan_peers", [])})
    floor = cases.floor_bytes(args[:2] if op == "scan" else args, y_ref.to(dtype), mode)
    return Case(op, {"preset": preset, "B": B, "T": T, "D": D, "resets": resets}, mode, variants, floor)


def layer_case(preset: str, D: int, blocks: int, mode: str, s: dict, device, dtype) -> Case:
    """Our RG-LRU layer and the official one (same weights) against our float64 layer."""
    grad, B, T, resets = mode == "fwd_bwd", s["B"], s["T"], s.get("resets", True)
    official, ref = cases.official_rglru(D, blocks, dtype, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(B, T, D, generator=g).to(device=device, dtype=dtype)
    pos = cases.positions(B, T, device, resets)
    grad_out = torch.randn(B, T, D, generator=g).to(device=device, dtype=dtype) if grad else None
    x64 = x.double().requires_grad_(grad)
    y_ref = ref(x64, pos)[0]
    g_ref = torch.autograd.grad(y_ref, [x64, *ref.parameters()], grad_out.double()) if grad else ()

    def variant(module, dt):
        m, xd = copy.deepcopy(module).to(dt), x.to(dt).requires_grad_(grad)
        call = cases.make_call(m, [xd, pos], {}, mode, grad_out.to(dt) if grad else None, [xd, *m.parameters()])
        names = [f"grad_{n}" for n in ["x", *(n for n, _ in m.named_parameters())]]
        return call, partial(grad_errors, cases.make_call(m, [xd, pos], {}, "fwd"), y_ref, call, g_ref, names)

    shapes = {"preset": preset, "B": B, "T": T, "D": D, "blocks": blocks, "resets": resets}
    floor = cases.floor_bytes([x, *(p.to(dtype) for p in official.parameters())], y_ref.to(dtype), mode)
    variants = {"ours": partial(variant, kernels.from_recurrentgemma(official)),
                "peer:recurrentgemma": partial(variant, official)}
    return Case("rglru_layer", shapes, mode, variants, floor)


def step_case(op: str, B: int, D: int, blocks: int, s: dict, device, dtype) -> Case:
    """kernels.<op>_step (SAMU's also with the engine's mode table; the official RG-LRU at T = 1):
    4 steps against float64."""
    fn = getattr(kernels, f"{op}_step")
    args, state0 = cases.step_inputs(op, B, D, blocks, dtype, device)
    ref_args = cast(args, torch.float64)
    ref_state = state0.to(torch.complex128 if state0.is_complex() else torch.float64)
    for _ in range(4):
        y_ref = fn(*ref_args, ref_state, None, backend="reference")

    def ours(dt, table=False):
        a, state = cast(args, dt), state0.clone()
        # the generation engine's call: the mode table computed once, outside the window
        kw = {"modes": kernels.ops.samu_mode_table(a[5], a[6], dt)} if table else {}
        return (lambda: fn(*a, state, None, **kw)), partial(
            step_errors, lambda st: (fn(*a, st, None, **kw), st), state0, y_ref, ref_state)

    def official(dt):
        m, _ = cases.official_rglru(D, blocks, dt, device)
        with torch.no_grad():
            for p, v in zip((m.input_gate.w, m.input_gate.b, m.a_gate.w, m.a_gate.b, m.a_param), args[1:]):
                p.copy_(v)
        m = m.to(dt)
        x, pos = args[0][:, None].to(dt), torch.ones(B, 1, dtype=torch.int64, device=device)

        def call():
            with torch.no_grad():
                return m(x, pos, state0.clone())[0]
        return call, partial(step_errors, lambda h: m(x, pos, h), state0, y_ref, ref_state)

    variants = {"ours": ours}
    if op == "samu":
        variants["ours+table"] = partial(ours, table=True)
    if op == "rglru" and "recurrentgemma" in s.get("step_peers", []):
        variants["peer:recurrentgemma"] = official
    floor = cases.floor_bytes(args, y_ref.to(dtype)) + 2 * cases.nbytes([state0])
    return Case(f"{op}_step", {"B": B, "D": D, "blocks": blocks}, "step", variants, floor)


def plan(s: dict, device):
    """Case builders in running order (built one at a time: inputs are freed between)."""
    dtype, out = getattr(torch, s["dtype"]), []
    for preset in s["presets"]:
        c = HawkConfig.preset(preset)
        for mode in s["modes"]:
            out += [partial(layer_case, preset, c.lru_width, c.gate_blocks, mode, s, device, dtype)
                    if op == "rglru_layer" else partial(op_case, op, preset, c.lru_width, mode, s, device, dtype)
                    for op in s["ops"]]
    if dec := s.get("decode"):
        c = HawkConfig.preset(dec["preset"])
        out += [partial(step_case, op, B, c.lru_width, c.gate_blocks, {**s, **dec}, device, dtype)
                for op in dec["ops"] for B in dec["batches"]]
    return out


def gated(case: Case, name: str, s: dict):
    """(timed call, the record's `gate`): ours gated in the track's dtype, a peer in PEER_GATE_DTYPE
    where it runs in it (its track-dtype errors recorded ungated)."""
    make, dtype = case.variants[name], getattr(torch, s["dtype"])
    gate = {"passed": True, "against": "float64 reference", "dtype": s["dtype"], "tolerance": s["check_tolerance"]}
    if not name.startswith("ours") and s["dtype"] != PEER_GATE_DTYPE:
        try:
            errs = make(getattr(torch, PEER_GATE_DTYPE))[1]()
        except Exception as exc:  # noqa: BLE001 - a peer without that dtype is gated in the track's
            gate["gate_dtype_error"] = f"{type(exc).__name__}: {exc}"[:300]
        else:
            gate.update(dtype=PEER_GATE_DTYPE, tolerance=PEER_GATE_TOL, max_rel_err=cases.checked(errs, PEER_GATE_TOL))
            call, errors = make(dtype)
            return call, {**gate, "timed_dtype": s["dtype"], "timed_dtype_rel_err": errors()}
    call, errors = make(dtype)
    return call, {**gate, "max_rel_err": cases.checked(errors(), s["check_tolerance"])}


def track(settings: dict, profile: str, records_dir, out_jsonl, bandwidth: float | None, restart=None,
          lock_clocks: bool = False) -> list:
    s, device = settings, measure.device_of()
    runner = measure.Runner("ops", profile, records_dir, s.get("budget_s"), device, restart=restart,
                            lock_clocks=lock_clocks)
    for build in plan(s, device):
        try:
            outcome = measure.capture(build, device)
        except measure.Skip as why:
            runner.say(f"a case does not apply here: {why}")
            continue
        if not outcome.ok:
            runner.say(f"a case could not be set up: {measure.error_text(outcome.error)[:300]}")
            continue
        case = outcome.value
        for order, seq, name in measure.orders(list(case.variants)):
            cid = f"{case.tag()}-{name.replace(':', '-')}-{order}"

            def body(name=name, reuse=runner.twin(cid)):
                call, gate = gated(case, name, s)
                f = measure.measure(call, s["reps"], s["warmup"], device, s.get("budget_s_per_config"), reuse,
                                    profile_calls=HOST_PROFILE_CALLS)
                return {**measure.floor_fields(f, case.floor, bandwidth), "gate": gate}

            ours = name.startswith("ours")
            # mixer stays null: the report's SAMU / RG-LRU ratios are the ops section's own.
            runner.run(cid, body, shapes=case.shapes, op=case.name, mixer=None, backend="auto" if ours else name,
                       variant=name, peer=not ours, mode=case.mode, order=order, sequence=seq, dtype=s["dtype"])
        del outcome, case
        measure.release(device)
    return runner.finish(out_jsonl)


def main(job):
    track(job.params["settings"], job.profile, job.params["records_dir"], job.output.records,
          measure.copy_bandwidth(job.load("environment")), restart=lambda: measure.reexec(job),
          lock_clocks=job.lock_clocks)


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
