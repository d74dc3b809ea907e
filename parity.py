"""Correctness gates: the comparisons that the tests and the pipeline's audit run. They sit
beside the `kernels` package, not in it: the oracle harness is not part of the product.

Every check returns rows {"check", "error" = rel_err(got, want), "tolerance", "passed",
...context}. Oracles: the official `recurrentgemma==1.0.1` torch code and the float64
references of kernels.ops.reference. Tolerances: OFFICIAL_FP32_TOL, BACKEND_TOL, and below
float32 LOWP_FACTOR times the error of the same computation in PyTorch at that precision, at
least the dtype's epsilon (two correct results may round one ulp apart). The reference
backend's rows below float64 are recorded, not gated (its error measures the conditioning).
"""

from __future__ import annotations

import atexit
import copy
import functools
import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch

from kernels import layers, ops
from kernels.convert import from_recurrentgemma
from kernels.models import CapturedTrainStep, HawkConfig, HawkLM, train_step
from kernels.official import load_official
from kernels.ops import reference, triton_utils
from kernels.ops.checks import state_dtype

OFFICIAL_FP32_TOL = 1e-5
BACKEND_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
LOWP_FACTOR = 2.0
LOWP_FLOOR = {torch.bfloat16: torch.finfo(torch.bfloat16).eps, torch.float16: torch.finfo(torch.float16).eps}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|got - want| / max|want| in float64 (absolute error if want is all zero)."""
    if got.shape != want.shape:
        raise ValueError(f"expected tensors of one shape, got {list(got.shape)} and {list(want.shape)}")
    if want.numel() == 0:
        return 0.0
    g = got.detach().to("cpu", torch.complex128 if got.is_complex() or want.is_complex() else torch.float64)
    w = want.detach().to("cpu", g.dtype)
    scale, diff = w.abs().max().item(), (g - w).abs().max().item()
    return diff / scale if scale > 0 else diff


def _row(check, error, tolerance, **context):
    """One row; a context's dtype and device by name ("float32", "cuda")."""
    error = float(error)
    context.update({k: str(context[k]).removeprefix("torch.") for k in ("dtype", "device") if k in context})
    return {"check": check, "error": error, "tolerance": float(tolerance),
            "passed": bool(math.isfinite(error) and error <= tolerance), **context}


def _lowp_tol(dtype, err_pytorch):
    return max(LOWP_FACTOR * err_pytorch, LOWP_FLOOR[dtype])


def make_segment_pos(B, T, resets=True, seed=0, device="cpu"):
    """Positions [B, T] (int64). With resets, rows cycle through: a continuation with two
    mid-sequence resets; resets at t = 0, at chunk edges and a run of three; resets at t = 0,
    1, T - 1 and at random; none. Without resets every position is >= 1."""
    g = torch.Generator().manual_seed(seed + 17)
    pos = torch.empty(B, T, dtype=torch.int64)
    for b in range(B):
        kind = b % 4 if resets else 3
        starts = torch.zeros(T, dtype=torch.bool)
        if kind == 0:
            starts[[t for t in (T // 3, (2 * T) // 3) if 0 < t < T]] = True
        elif kind == 1:
            starts[[t for t in (0, 8, 16, 32, 64, T // 2, T // 2 + 1, T // 2 + 2) if t < T]] = True
        elif kind == 2:
            starts[: min(2, T)] = True
            starts |= torch.rand(T, generator=g) < 0.1
            starts[T - 1] = True
        t = torch.arange(T)
        offset = {0: 3, 3: 7 + b}.get(kind, 0)     # the position at t = 0 of a row without a start there
        pos[b] = t - torch.cummax(torch.where(starts, t, -offset), 0).values
    return pos.to(device)


def _positions(B, T, n, resets, seed, device, width=0):
    """(pos [B, T] of make_segment_pos, [B, n] positions continuing it). No document starts
    in pos's last `width` positions (continued from the position before): the official
    conv cache keeps the previous document's inputs there."""
    pos = make_segment_pos(B, T, resets, seed, device)
    tail = T - width
    if tail > 0 and bool((pos[:, tail:] == 0).any()):
        pos[:, tail:] = pos[:, tail - 1:tail] + 1 + torch.arange(width, device=device)
    return pos, pos[:, -1:] + 1 + torch.arange(n, device=device)


def _official(dtype, seed, build, backend="auto", bias_std=0.0):
    """(official, ours): `build(recurrentgemma.torch)` seeded, biases and norm scales ~
    N(0, bias_std**2), parameters rounded to `dtype` (kept FP32); ours its conversion."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"expected dtype float32, bfloat16 or float16 for an official check, got {dtype}")
    torch.manual_seed(seed)
    official = build(load_official())
    with torch.no_grad():
        for n, p in official.named_parameters():
            if bias_std and n.rsplit(".", 1)[-1] in ("b", "bias", "scale"):
                p.normal_(std=bias_std)
            p.copy_(p.to(dtype).to(p.dtype))
    return official, from_recurrentgemma(official, backend=backend).to(dtype)


def _decode(m, inp, dpos, cache):
    """One-token steps of inputs inp(i) at positions dpos [B, n] from `cache` (official
    modules: one-token forwards). Returns (outputs or None, final cache, tensor caches)."""
    ys, trail = [], []
    for i in range(dpos.shape[1]):
        p = dpos[:, i: i + 1]
        if isinstance(m, HawkLM):
            ys.append(m.step(inp(i), p[:, 0], cache))
        elif hasattr(m, "step"):
            ys.append(m.step(inp(i), cache, p[:, 0] == 0))
        else:
            y, cache = m(inp(i)[:, None], p, cache)
            ys.append(y[:, 0])
        if isinstance(cache, torch.Tensor):
            trail.append(cache.clone())
    return (torch.stack(ys, 1) if ys else None), cache, trail


def _official_rows(name, run, official, ours, dtype, context):
    """One row per stage of `run(module, dtype) -> {stage: tensor}`: ours at `dtype` against
    the FP32 official module; below float32 the yardstick is the smaller error of the official
    module and ours on the reference backend at `dtype` (SPEC 4)."""
    with torch.no_grad():
        want = run(official, torch.float32)
        got = run(ours, dtype)
        if dtype != torch.float32:
            yards = (run(copy.deepcopy(official).to(dtype), dtype),
                     run(layers.set_backend(copy.deepcopy(ours), "reference"), dtype))
    rows = []
    for stage, w in want.items():
        tol = (OFFICIAL_FP32_TOL if dtype == torch.float32
               else _lowp_tol(dtype, min(rel_err(y[stage], w) for y in yards)))
        rows.append(_row(f"{name}/{stage}", rel_err(got[stage], w), tol, stage=stage, **context))
    return rows


def check_rglru_official(B=2, T=37, D=24, heads=4, device="cpu", dtype=torch.float32, seed=0,
                         resets=True, backend="reference", decode_steps=4):
    """RG-LRU against the official layer: outputs and final states from an empty and a cached
    state, the gradients of x, the initial state and every parameter, then decode steps."""
    official, ours = _official(dtype, seed, lambda rg: rg.RGLRU(D, heads, device=device), backend)
    x = torch.randn(B, T + decode_steps, D, device=device).to(dtype).float()
    h0 = torch.randn(B, D, device=device)
    pos, dpos = _positions(B, T, decode_steps, resets, seed, device)
    if resets and decode_steps > 1:
        dpos[0, 1:] = torch.arange(decode_steps - 1, device=device)      # a reset while decoding

    g = torch.Generator(device="cpu").manual_seed(seed + 3)
    gy, gh = torch.randn(B, T, D, generator=g).to(device), torch.randn(B, D, generator=g).to(device)

    def run(m, dt):
        xs = x[:, :T].to(dt, copy=True)
        out = dict(zip(("sequence", "final_state"), m(xs, pos)))
        with torch.enable_grad():
            # Backward through the cached call: x, the initial state and every parameter.
            xg, hg = xs.clone().requires_grad_(), h0.clone().requires_grad_()
            params = dict(m.named_parameters())
            y, h = m(xg, pos, hg)
            loss = (y.float() * gy).sum() + (h.float() * gh).sum()
            grads = torch.autograd.grad(loss, [xg, hg, *params.values()])
        out["sequence_cached"], out["final_state_cached"] = y.detach(), h.detach().clone()
        out.update({f"grad_{n}": gr for n, gr in zip(["x", "initial_state", *params], grads)})
        ys, _, hs = _decode(m, lambda i: x[:, T + i].to(dt), dpos, h.detach().clone())
        if decode_steps:
            out["decode"], out["decode_state"] = ys, torch.stack(hs, 1)
        return out

    ctx = dict(shape=[B, T, D], heads=heads, dtype=dtype, device=device, backend=backend, resets=resets)
    return _official_rows("rglru_official", run, official, ours, dtype, ctx)


def check_conv1d_official(B=2, T=37, D=24, temporal_width=4, device="cpu", dtype=torch.float32, seed=0,
                          resets=True, decode_steps=4):
    """Conv1D against the official layer: the sequence, its decode cache and decode steps.
    No document starts in the prompt's last temporal_width - 1 positions (the official cache
    keeps the previous document's inputs there; check_griffin_official covers them)."""
    official, ours = _official(dtype, seed, lambda rg: rg.Conv1D(D, temporal_width, device=device), bias_std=1.0)
    x = torch.randn(B, T + decode_steps, D, device=device).to(dtype).float()
    pos, dpos = _positions(B, T, decode_steps, resets, seed, device, temporal_width - 1)

    def run(m, dt):
        # Fresh copies: the official Conv1D masks its input in place.
        y, cache = m(x[:, :T].to(dt, copy=True), pos)
        out = {"sequence": y, "cache": cache.clone()}
        ys, cache, _ = _decode(m, lambda i: x[:, T + i].to(dt), dpos, cache)
        if decode_steps:
            out["decode"], out["decode_cache"] = ys, cache
        return out

    ctx = dict(shape=[B, T, D], dtype=dtype, device=device, resets=resets)
    return _official_rows("conv1d_official", run, official, ours, dtype, ctx)


_BLOCK_STAGES = {   # stage: its module's path, the same in ours and the official block
    "norm": "temporal_pre_norm", "linear_x": "recurrent_block.linear_x", "linear_y": "recurrent_block.linear_y",
    "conv1d": "recurrent_block.conv_1d", "rglru_sequence": "recurrent_block.rg_lru",
    "temporal_block": "recurrent_block", "channel_norm": "channel_pre_norm", "mlp": "mlp_block"}


def check_residual_block_official(B=2, T=37, width=32, lru_width=48, heads=4, mlp_expanded_width=96,
                                  device="cpu", dtype=torch.float32, seed=0, resets=True,
                                  backend="reference", decode_steps=3):
    """The Hawk residual block against the official one, stage by stage (_BLOCK_STAGES, the
    output, both states), then decode steps."""
    official, ours = _official(dtype, seed, lambda rg: rg.ResidualBlock(
        width, mlp_expanded_width, heads, 1024, rg.TemporalBlockType.RECURRENT, lru_width, device=device),
        backend, bias_std=0.1)
    x = torch.randn(B, T + decode_steps, width, device=device).to(dtype).float()
    pos, dpos = _positions(B, T, decode_steps, resets, seed, device, 3)

    def states(c):
        if isinstance(c, layers.RecurrentCache):
            return c.rnn_state.clone(), c.conv_state.clone()
        return c.rg_lru_state, c.conv1d_state

    def run(m, dt):
        seen = {}

        def hook(stage):
            # Cloned: the official Conv1D masks its input in place.
            return lambda _m, _inp, out: seen.update({stage: (out[0] if isinstance(out, tuple) else out).clone()})
        handles = [m.get_submodule(path).register_forward_hook(hook(s)) for s, path in _BLOCK_STAGES.items()]
        try:
            y, cache = m(x[:, :T].to(dt, copy=True), pos)
        finally:
            for h in handles:
                h.remove()
        out = dict(seen, block_output=y)
        out["final_state"], out["conv_state"] = states(cache)
        ys, cache, _ = _decode(m, lambda i: x[:, T + i].to(dt), dpos, cache)
        if decode_steps:
            out["decode_output"] = ys
            out["decode_state"], out["decode_conv_state"] = states(cache)
        return out

    ctx = dict(shape=[B, T, width], lru_width=lru_width, heads=heads, dtype=dtype, device=device, backend=backend,
               resets=resets)
    return _official_rows("residual_block_official", run, official, ours, dtype, ctx)


def check_griffin_official(B=2, T=29, vocab_size=97, width=32, lru_width=48, heads=4, num_layers=2,
                           device="cpu", dtype=torch.float32, seed=0, resets=True, backend="reference",
                           decode_steps=4):
    """A tiny all-recurrent Griffin against HawkLM: logits of a forward, then of decode steps.
    Ours alone: prompt + decode steps and chunked prefill equal one full forward."""
    official, ours = _official(dtype, seed, lambda rg: rg.Griffin(rg.GriffinConfig(
        vocab_size=vocab_size, width=width, mlp_expanded_width=3 * width, num_heads=heads,
        block_types=(rg.TemporalBlockType.RECURRENT,) * num_layers, embeddings_scale_by_sqrt_dim=False,
        attention_window_size=1024, logits_soft_cap=0.0, lru_width=lru_width), gradient_checkpointing=False,
        device=device), backend, bias_std=0.1)
    tokens = torch.randint(0, vocab_size, (B, T + decode_steps), device=device)
    pos, dpos = _positions(B, T, decode_steps, resets, seed, device, 3)

    def run(m, dt):
        logits, cache = m(tokens[:, :T], pos)
        out = {"logits": logits}
        if decode_steps:
            out["decode_logits"] = _decode(m, lambda i: tokens[:, T + i], dpos, cache)[0]
        return out

    ctx = dict(shape=[B, T], vocab_size=vocab_size, width=width, lru_width=lru_width, heads=heads,
               num_layers=num_layers, dtype=dtype, device=device, backend=backend, resets=resets)
    rows = _official_rows("griffin_official", run, official, ours, dtype, ctx)

    g = torch.Generator(device="cpu").manual_seed(seed + 5)
    tokens = torch.randint(0, vocab_size, (B, T + decode_steps), generator=g).to(device)
    pos = make_segment_pos(B, T + decode_steps, resets, seed + 1, device)
    if resets and T >= 2 and decode_steps >= 2:
        pos[0, T - 2:] = torch.arange(decode_steps + 2, device=device)  # start in the prompt tail
        pos[-1, T + 1:] = torch.arange(decode_steps - 1, device=device)  # start while decoding
    with torch.no_grad():
        full, _ = ours(tokens, pos, return_cache=False)
        head, cache = ours(tokens[:, :T], pos[:, :T])
        steps_out = [ours.step(tokens[:, T + i], pos[:, T + i], cache) for i in range(decode_steps)]
        dec = torch.cat([head, torch.stack(steps_out, 1)], 1) if decode_steps else head
        tail_cache = ours(tokens[:, :T - 1], pos[:, :T - 1])[1]
        chunk, _ = ours(tokens[:, T - 1:], pos[:, T - 1:], tail_cache)
        want, tol = full, OFFICIAL_FP32_TOL
        if dtype != torch.float32:
            # Both judged against the FP32 forward, within twice the full forward's own error.
            want, _ = copy.deepcopy(ours).float()(tokens, pos, return_cache=False)
            tol = _lowp_tol(dtype, rel_err(full, want))
    return rows + [_row(check, rel_err(got, want), tol, **ctx)
                   for check, got in (("hawk/decode_equals_forward", dec),
                                      ("hawk/chunked_prefill_equals_forward", torch.cat([head[:, :T - 1], chunk], 1)))]


def check_samu_reference(B=2, T=37, D=24, device="cpu", seed=0, resets=True):
    """SAMU two independent ways in float64, complex128 `reference.samu` against real
    `reference.samu_real`: outputs, final states and every gradient, from both states."""
    args, h0 = _inputs("samu", B, T, D, torch.float64, device, seed)
    pos = make_segment_pos(B, T, resets, seed, device)
    ctx = dict(shape=[B, T, D], dtype="float64", device=device, resets=resets)
    rows = []
    for tag, h in (("empty", None), ("cached", h0)):
        cplx, real = (_run_op(fn, args, h, pos, {}, seed, None, INPUT_NAMES["samu"])
                      for fn in (reference.samu, reference.samu_real))
        rows += [_row(f"samu_reference/{k}_{tag}", rel_err(real[k], cplx[k]), BACKEND_TOL[torch.float64],
                      **ctx) for k in real]
    return rows


INPUT_NAMES = {"rglru": ("x", "gate_x", "gate_a", "a_param"), "scan": ("a", "b"),
               "samu": ("x", "phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log")}


def _inputs(op, B, T, D, dtype, device, seed):
    """(inputs of `op` in `dtype`, initial state): activations ~ N(0, 1) [B, T, D], parameters
    at the layers' initialisation (SAMU: a non-zero controller bias), the scan's |a| near 1."""
    torch.manual_seed(seed)
    kw = dict(dtype=dtype, device=device)
    if op == "samu":
        m = layers.SAMU(D, **kw)
        with torch.no_grad():
            m.phase_dir[-1], m.radial_dir[-1] = 0.3, -0.2
        args = [torch.randn(B, T, D, **kw)] + [p.detach() for p in m.step_params()]
        return args, torch.randn(B, D // 2, dtype=torch.complex128, device=device)
    if op == "rglru":
        args = [torch.randn(B, T, D, **kw) for _ in range(3)] + [layers.rnn_param_init(torch.empty(D, **kw))]
    else:
        args = [torch.rand(B, T, D, **kw) * 0.1 + 0.899, torch.randn(B, T, D, **kw)]
    return args, torch.randn(B, D, **kw)


def _real(t):
    return torch.view_as_real(t) if t.is_complex() else t


def _run_op(fn, args, h0, pos, opts, seed, kinks, names):
    """{output, final_state, grad_<input> (zeros for None), grad_initial_state} of one backend
    for the loss sum(y * gy) + sum(h * gh), seeded cotangents, gy zero at `kinks`."""
    leaves = [a.detach().clone().requires_grad_() for a in args]
    hs = None if h0 is None else h0.detach().clone().requires_grad_()
    y, h = fn(*leaves, pos, hs, True, **opts)
    g = torch.Generator(device="cpu").manual_seed(seed + 99)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device, y.dtype)
    gh = torch.randn(h.shape, generator=g, dtype=torch.complex128 if h.is_complex() else torch.float64)
    gh = gh.to(h.device, h.dtype)
    if kinks is not None:
        gy = gy.masked_fill(kinks, 0)
    loss = sum((_real(t).double() * _real(c).double()).sum() for t, c in ((y, gy), (h, gh)))
    wrt = leaves + ([] if hs is None else [hs])
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, wrt)]
    keys = ["output", "final_state"] + [f"grad_{n}" for n in (*names, "initial_state")]
    return dict(zip(keys, [y, h, *grads]))


def _backend_rows(check, backend, got, want, yard, dtype, ctx):
    """One row per stage, within BACKEND_TOL[dtype] or, below float32, _lowp_tol of the error
    of `yard` (the reference at `dtype`). Recorded, not gated: the reference below float64
    and a backend inexact by design."""
    role = ("yardstick" if backend == "reference" and dtype != torch.float64
            else "inexact-by-design" if backend in ops.inexact_backends() else None)
    rows = []
    for k in want:
        tol = BACKEND_TOL[dtype] if dtype in BACKEND_TOL else _lowp_tol(dtype, rel_err(yard[k], want[k]))
        row = _row(f"{check}/{k}", rel_err(got[k], want[k]), tol, stage=k, **ctx)
        if role:
            row.update(passed=True, role=role, within_tolerance=row["passed"])
        rows.append(row)
    return rows


KINK_REL = 10 * 2.0**-20


def samu_relu_kinks(args64, h064, pos):
    """Where SAMU's exact pre-relu state is within KINK_REL * max|h| of zero: relu's
    derivative jumps there and the side an FP32 state lands on is rounding luck for any
    implementation, so every run of a comparison zeroes the output cotangent there."""
    with torch.no_grad():
        a, b = reference.samu_coefficients(*args64, pos)
        h_all, _ = reference.scan(a, b, pos, h064, False)
        h = torch.cat([h_all.real, h_all.imag], dim=-1)
        return h.abs() <= KINK_REL * h.abs().max()


def check_backends(op, B=2, T=37, D=24, device="cpu", dtype=torch.float32, chunk_sizes=(8, 16), seed=0, resets=True):
    """Every backend of `op` ("rglru", "samu", "scan") against the float64 reference: output,
    final state and every gradient, with resets and a non-zero initial state; "chunk" once
    per chunk size; off the interpreter the second of two identical calls, which replays the
    first one's launches. Activations in `dtype`, parameters and the state in state_dtype(dtype)."""
    if op not in INPUT_NAMES:
        raise ValueError(f"expected op in ['rglru', 'samu', 'scan'], got {op!r}")
    names = INPUT_NAMES[op]
    args64, h064 = _inputs(op, B, T, D, torch.float64, device, seed)
    args = [a.to(dtype if a.dim() == 3 else state_dtype(dtype)) for a in args64]   # activations [B, T, D]
    h0 = h064.to(state_dtype(dtype, h064.is_complex()))
    pos = make_segment_pos(B, T, resets, seed, device)
    args_exact, h0_exact = [a.double() for a in args], h0.to(h064.dtype)
    kinks = samu_relu_kinks(args_exact, h0_exact, pos) if op == "samu" else None
    ref = ops.backends(op)["reference"]
    # The exact answer for exactly these (rounded) inputs.
    want = _run_op(ref, args_exact, h0_exact, pos, {}, seed, kinks, names)
    yard = None if dtype in BACKEND_TOL else _run_op(ref, args, h0, pos, {}, seed, kinks, names)
    rows = []
    for name, fn in ops.backends(op).items():
        for opts in [{"chunk_size": k} for k in chunk_sizes] if name == "chunk" else [{}]:
            ctx = dict(op=op, backend=name, shape=[B, T, D], dtype=dtype, device=device,
                       resets=resets, relu_kinks_masked=0 if kinks is None else int(kinks.sum()), **opts)
            if name != "reference" and not triton_utils.INTERPRET:
                # the first call keeps its launches; the gated second one replays them with its
                # own tensors (triton_utils.replayed)
                _run_op(fn, args, h0, pos, opts, seed, kinks, names)
            got = _run_op(fn, args, h0, pos, opts, seed, kinks, names)
            rows += _backend_rows(f"backends/{op}/{name}", name, got, want, yard, dtype, ctx)
    return rows


def _public_step(op, name, x) -> bool:
    """Whether the public op kernels.ops.<op>_step takes backend `name`."""
    try:
        ops.resolve(f"{op}_step", name, x)
    except ValueError:
        return False
    return True


def check_steps(op, B=3, D=24, heads=4, steps=4, device="cpu", dtype=torch.float32, seed=0, options=None):
    """Every decode step backend of `op` ("rglru", "samu") against the float64 reference: the
    outputs and final state of `steps` steps from a non-zero state, row 0 reset at step 2 and
    every row at step 3. options {"op/backend": [launcher options, ...]} add a variant per
    set; SAMU's Triton steps also run reading the mode table."""
    if op not in ("rglru", "samu"):
        raise ValueError(f"expected op in ['rglru', 'samu'], got {op!r}")
    torch.manual_seed(seed)
    m = layers.RGLRU(D, heads, device=device, dtype=dtype) if op == "rglru" else layers.SAMU(D, device=device)
    params = [p.detach() for p in m.step_params()]
    exact = torch.complex128 if m.COMPLEX_STATE else torch.float64
    state0 = 0.5 * torch.randn(B, m.state_width, device=device, dtype=exact)
    xs = [torch.randn(B, D, device=device, dtype=torch.float64).to(dtype) for _ in range(steps)]
    resets = [None, torch.arange(B, device=device) == 0, torch.ones(B, dtype=torch.bool, device=device)]
    resets += [None] * (steps - len(resets))
    sdt = state_dtype(dtype, m.COMPLEX_STATE)
    state0 = state0.to(sdt)

    def run(fn, cast, st_dtype):
        st = state0.to(st_dtype).clone()
        with torch.no_grad():
            ys = [fn(cast(x), *[cast(q) if q.is_floating_point() else q for q in params], st, r)
                  for x, r in zip(xs, resets)]
        return {"output": torch.stack(ys), "state": st}

    fns = ops.step_backends(op)
    want = run(fns["reference"], lambda t: t.double(), exact)
    yard = None if dtype in BACKEND_TOL else run(fns["reference"], lambda t: t, sdt)
    variants = [(n, f, {}) for n, f in fns.items()]
    for key, sets in (options or {}).items():
        o, n = key.split("/")
        variants += [(n, functools.partial(fns[n], **opts), opts) for opts in sets if o == op and opts]
    # through the public op too: a repeated call signature replays its launch (steps 3 and 4)
    variants += [(f"{n}+public", functools.partial(getattr(ops, f"{op}_step"), backend=n), {}) for n in fns
                 if n != "reference" and _public_step(op, n, xs[0])]
    if op == "samu":
        tab = ops.samu_mode_table(m.nu_log.detach(), m.theta_log.detach(), dtype)
        variants += [(f"{n}+table", functools.partial(f, modes=tab), opts) for n, f, opts in variants
                     if n != "reference"]
    rows = []
    for name, fn, opts in variants:
        ctx = dict(op=f"{op}_step", backend=name, shape=[B, D], dtype=dtype, device=device, steps=steps,
                   **({"options": opts} if opts else {}))
        tag = "".join(f"/{k}={v}" for k, v in sorted(opts.items()))
        rows += _backend_rows(f"backends/{op}_step/{name}{tag}", name, run(fn, lambda t: t, sdt), want, yard,
                              dtype, ctx)
    return rows


def check_captured_train_step(preset="tiny", B=2, T=64, vocab_size=256, steps=3, device="cuda",
                              dtype=torch.float32, seed=0, backend="auto"):
    """`CapturedTrainStep` against the same steps run eagerly, per mixer: each loss and every
    parameter after the last step (bfloat16 / float16: FP32 weights under autocast). Both
    launch the same kernels in the same order: BACKEND_TOL's float32 one at every dtype."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"a captured training step needs a CUDA device, got {device!r}")
    autocast = None if dtype == torch.float32 else dtype
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, vocab_size, (steps + 1, B, T + 1), generator=g).to(device)
    pos = make_segment_pos(B, T, resets=True, seed=seed, device=device)
    tol = BACKEND_TOL[torch.float32]
    rows = []
    for mixer in ("rglru", "samu"):
        cfg = HawkConfig.preset(preset, mixer=mixer, vocab_size=vocab_size)
        runs = []
        for captured in (False, True):
            torch.manual_seed(seed)
            m = HawkLM(cfg, backend=backend, device=device, dtype=torch.float32)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True)
            first = (toks[0, :, :-1], toks[0, :, 1:], pos)
            if captured:
                step = CapturedTrainStep(m, opt, *first, autocast=autocast, warmup=1)
            else:
                train_step(m, opt, *first, autocast=autocast)
                step = functools.partial(train_step, m, opt, autocast=autocast)
            losses = [step(t[:, :-1], t[:, 1:], pos).clone() for t in toks[1:]]    # the captured loss is overwritten
            runs.append((torch.stack(losses), dict(m.named_parameters())))
        (want_loss, want_p), (got_loss, got_p) = runs
        ctx = dict(preset=preset, mixer=mixer, shape=[B, T], steps=steps, dtype=dtype, device=device, backend=backend)
        rows += [_row("train/captured_step/loss", rel_err(got_loss, want_loss), tol, **ctx),
                 _row("train/captured_step/parameters", max(rel_err(got_p[k], w) for k, w in want_p.items()), tol,
                      **ctx)]
    return rows


DEFAULT_PROFILE = {
    "backends": [{"B": 2, "T": 37, "D": 24}],
    "rglru_official": [{"B": 3, "T": 37, "D": 24, "heads": 4}],
    "conv1d_official": [{"B": 3, "T": 37, "D": 24}],
    "residual_block_official": [{"B": 3, "T": 29, "width": 32, "lru_width": 48, "heads": 4}],
    "griffin_official": [{"B": 3, "T": 21, "vocab_size": 97, "width": 32, "lru_width": 48, "heads": 4}],
    "samu_reference": [{"B": 2, "T": 37, "D": 24}],
    "steps": [{"B": 3, "D": 24, "heads": 4}],
    # a CUDA graph needs a GPU: profiles that audit on one name shapes here
    "captured_train": [],
}


_POOLS: dict = {}


def _pool(workers: int):
    """`workers` spawned processes, kept for this process's life. Each compiles the Triton kernels its checks launch:
    an audit's time on a fresh machine is mostly compilation, which they share out."""
    if workers not in _POOLS:     # a worker that dies raises BrokenProcessPool here rather than hanging the map
        _POOLS[workers] = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        atexit.register(_POOLS[workers].shutdown)
    return _POOLS[workers]


def _check(check, kw: dict) -> list:
    return check(**kw)


def run_gates(profile_shapes: dict | None = None, device="cpu", dtype=torch.float32, backend="reference",
              workers: int = 1):
    """The rows of every gate. profile_shapes: {gate: [its check's keyword arguments]} (missing:
    DEFAULT_PROFILE's, []: skipped); `backend`: the official-parity modules' mixer backend.
    The official gates run with and without resets, in float32 for float64; with workers > 1
    in that many processes (the rows in the same order)."""
    profile = {**DEFAULT_PROFILE, **(profile_shapes or {})}
    unknown = set(profile) - set(DEFAULT_PROFILE)
    if unknown:
        raise ValueError(f"expected profile_shapes keys in {list(DEFAULT_PROFILE)}, got unknown {sorted(unknown)}")
    odt = torch.float32 if dtype == torch.float64 else dtype
    mixer, here = dict(device=device, dtype=odt, backend=backend), dict(device=device, dtype=dtype)
    calls = [("backends", check_backends, [dict(here, op=op) for op in ("rglru", "samu", "scan")]),
             ("steps", check_steps, [dict(here, op=op) for op in ("rglru", "samu")])]
    for resets in (True, False):
        calls += [("rglru_official", check_rglru_official, [dict(mixer, resets=resets)]),
                  ("conv1d_official", check_conv1d_official, [dict(device=device, dtype=odt, resets=resets)]),
                  ("residual_block_official", check_residual_block_official, [dict(mixer, resets=resets)]),
                  ("griffin_official", check_griffin_official, [dict(mixer, resets=resets)]),
                  ("samu_reference", check_samu_reference, [dict(device=device, resets=resets)])]
    calls.append(("captured_train", check_captured_train_step, [mixer]))
    # [(gate, its check, keyword arguments besides the shapes)] -> one (check, arguments) per call
    jobs = [(check, {**v, **kw}) for gate, check, variants in calls for kw in profile[gate] for v in variants]
    rows = _pool(workers).map(_check, *zip(*jobs)) if workers > 1 and jobs else [_check(*job) for job in jobs]
    return [r for got in rows for r in got]


def failures(rows):
    return [r for r in rows if not r["passed"]]
