"""One-token SAMU decode step in one launch (controller, transition, write, in-place state update), CUDA-graph
capturable. "row": one program per sequence walks all modes; "blocked": one program per (sequence, mode block), each
recomputing its row's projections; "fused": "blocked" below ROW_MIN_BATCH sequences (ROW_MIN_BATCH_TABLE with a mode
table), where the two crossed on an H200. Without `modes` every program recomputes the per-mode constants in float64.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ..accounting import account
from ..checks import check_tensor, no_grad_inputs, state_dtype
from ..triton_utils import INTERPRET, cdiv, check_pow2, empty_like, launcher, multiprocessors, next_pow2, replay
from ..triton_utils import tl_acc as tl_dtype
from .common import controller, dir_cols, load_modes, load_pair, mode_consts64, relu, scalar_param, store_pair

ROW_MIN_BATCH = 64
ROW_MIN_BATCH_TABLE = 32      # "row" recomputes the most constants per program without the table
ROW_BLOCK_M = 2048            # modes per iteration of the row step (per program of the blocked step), at most
ROW_DEFAULT_BLOCK_M = 256     # the fastest of 256, 512, 2048 at every batch of the H200 decode tune (B 16 to 256)
# The controller reduction's width: the whole row (4096 at D = 2560) takes ~120 registers a thread at 8 warps (two
# programs per multiprocessor), half of it ~64 (four): the half beyond two rows per multiprocessor (one wave).
ROW_BLOCK_D = 4096
ROW_MANY_ROWS_BLOCK_D = 2048


@triton.jit
def _load_modes(x_b, s_b, nu_log, theta_log, modes, m0, M, BM: tl.constexpr, ACC: tl.constexpr, TABLE: tl.constexpr):
    """Modes m0 .. m0 + BM - 1: their constants, state and input (nothing of the controls)."""
    offs_m = m0 + tl.arange(0, BM)
    mask_m = offs_m < M
    if TABLE:
        nu, ct, st, gam, lnr = load_modes(modes, M, offs_m, mask_m)
    else:
        nu, _, ct, st, gam, lnr, _ = mode_consts64(nu_log, theta_log, offs_m, mask_m, ACC)
    hr, hi = load_pair(s_b, offs_m, mask_m, 0.0, 0.0)
    xr = tl.load(x_b + offs_m, mask=mask_m, other=0.0).to(ACC)
    xi = tl.load(x_b + M + offs_m, mask=mask_m, other=0.0).to(ACC)
    return offs_m, mask_m, nu, ct, st, gam, lnr, hr, hi, xr, xi


@triton.jit
def _update_modes(y_b, s_b, M, E, ck, sk, offs_m, mask_m, nu, ct, st, gam, lnr, hr, hi, xr, xi):
    mag = tl.exp(-(nu * E + lnr))
    ar, ai = mag * (ct * ck - st * sk), mag * (st * ck + ct * sk)
    hr, hi = ar * hr - ai * hi + gam * xr, ar * hi + ai * hr + gam * xi
    store_pair(s_b, offs_m, hr, hi, mask_m)
    tl.store(y_b + offs_m, relu(hr).to(y_b.dtype.element_ty), mask=mask_m)
    tl.store(y_b + M + offs_m, relu(hi).to(y_b.dtype.element_ty), mask=mask_m)


# D and M specialised (Triton keys ints on divisibility by 16): a row's offsets b * D and M are then known 16-element
# aligned, and the loads are vectorised.
@launcher
@triton.jit
def _step_kernel(x, pd, rd, pa, ra, nu_log, theta_log, modes, state, reset, y, D, M, scale, HAS_RESET: tl.constexpr,
                 ROW: tl.constexpr, TABLE: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr):
    b = tl.program_id(0 if ROW else 1).to(tl.int64)
    x_b, y_b, s_b = x + b * D, y + b * D, state + b * M * 2
    keep = 1.0
    if HAS_RESET:
        keep = tl.where(tl.load(reset + b) != 0, 0.0, 1.0)
    # The (first) block's loads go out before the row's reduction, whose latency they overlap (the state comes from
    # DRAM in a model: one layer's state per step); the row step then walks its remaining blocks.
    m0 = 0 if ROW else tl.program_id(0) * BM
    offs_m, mask_m, nu, ct, st, gam, lnr, hr, hi, xr, xi = _load_modes(x_b, s_b, nu_log, theta_log, modes, m0, M,
                                                                      BM, ACC, TABLE)
    zp, zr = tl.zeros([BD], ACC), tl.zeros([BD], ACC)
    wpp, wrr = tl.zeros([BD], ACC), tl.zeros([BD], ACC)
    for d0 in range(0, D, BD):
        cols, cm, wp, wr = dir_cols(pd, rd, d0, D, BD, ACC)
        xv = tl.load(x_b + cols, mask=cm, other=0.0).to(ACC)
        zp, zr = zp + xv * wp, zr + xv * wr
        wpp, wrr = wpp + wp * wp, wrr + wr * wr
    _, _, eta, d = controller(tl.sum(zp, axis=0), tl.sum(zr, axis=0), tl.sum(wpp, axis=0), tl.sum(wrr, axis=0),
                            pd, rd, pa, ra, D, scale, ACC)
    E = tl.exp(eta).to(ACC)
    ck, sk = tl.cos(d) * keep, tl.sin(d) * keep
    _update_modes(y_b, s_b, M, E, ck, sk, offs_m, mask_m, nu, ct, st, gam, lnr, hr, hi, xr, xi)
    if ROW:
        for m1 in range(BM, M, BM):
            offs_m, mask_m, nu, ct, st, gam, lnr, hr, hi, xr, xi = _load_modes(x_b, s_b, nu_log, theta_log, modes,
                                                                              m1, M, BM, ACC, TABLE)
            _update_modes(y_b, s_b, M, E, ck, sk, offs_m, mask_m, nu, ct, st, gam, lnr, hr, hi, xr, xi)


def _amp(v, x):
    """An amplitude as a one-element tensor (a float in x's accumulation dtype)."""
    return v if isinstance(v, torch.Tensor) else scalar_param(v, x.device, state_dtype(x.dtype))


def _row_block_d(B, D, device):
    """The row step's default reduction width for B rows (see ROW_MANY_ROWS_BLOCK_D)."""
    sms = multiprocessors(device)
    return min(next_pow2(D), ROW_MANY_ROWS_BLOCK_D if sms is not None and B > 2 * sms else ROW_BLOCK_D)


def _launch(layout: str, x: Tensor, phase_dir: Tensor, radial_dir: Tensor, phase_amp: Tensor, radial_amp: Tensor,
            nu_log: Tensor, theta_log: Tensor, state: Tensor, reset: Optional[Tensor], modes: Optional[Tensor],
            block_m: int = 0, block_d: int = 0, num_warps: int = 0) -> Tensor:
    B, D = x.shape
    M = D // 2
    if not state.is_contiguous():
        raise ValueError("expected a contiguous state (it is updated in place), got a strided view")
    if state.is_conj():
        raise ValueError("expected a state without a pending conjugation (it is updated in place), got a "
                         "conjugate view (h.conj()); pass h.conj().resolve_conj() and keep that tensor")
    x = x.contiguous()
    sr = torch.view_as_real(state)
    y = empty_like(x)
    if B == 0:
        return y
    rs = reset.contiguous().view(torch.uint8) if reset is not None else sr
    args = (x, phase_dir.contiguous(), radial_dir.contiguous(), phase_amp, radial_amp, nu_log.contiguous(),
            theta_log.contiguous(), sr if modes is None else modes.contiguous(), sr, rs, y, D, M, 1.0 / math.sqrt(M))
    if layout == "row":
        grid, BM, BD = (B,), block_m or min(next_pow2(M), ROW_DEFAULT_BLOCK_M), block_d or _row_block_d(B, D, x.device)
    else:
        grid, BM, BD = (cdiv(M, block_m or 128), B), block_m or 128, min(next_pow2(D), ROW_BLOCK_D)
    _step_kernel[grid](*args, HAS_RESET=reset is not None, TABLE=modes is not None, ROW=layout == "row", BD=BD, BM=BM,
                       ACC=tl_dtype(sr.dtype), num_warps=num_warps or (8 if layout == "row" else 4))
    account(f"samu_step_{layout}", (x, phase_dir, radial_dir, *((nu_log, theta_log) if modes is None else (modes,)),
                                    sr, reset), (sr, y))
    return y


# under torch.compile: the launcher as the custom op kernels::samu_step
_step_op = torch.library.custom_op("kernels::samu_step", _launch, mutates_args=("state",))


@_step_op.register_fake
def _(layout, x, *args):
    return torch.empty_like(x)


def _step(layout, x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state, reset, modes=None,
          name=None, block_m=0, block_d=0, num_warps=0, plan=None):
    """The custom op kernels::samu_step under torch.compile, else the launcher. An input
    requiring grad under grad mode raises ValueError naming the step (default the layout).
    `plan`: as kernels.ops.rglru.step.rglru_step's."""
    pa, ra = _amp(phase_amp, x), _amp(radial_amp, x)
    ts = (x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, state if modes is None else modes, state,
          state if reset is None else reset)
    fast = plan is not None and not INTERPRET and not torch.compiler.is_compiling()
    # the plan's signature fixes each tensor's strides (contiguous where the plan exists), not the conjugate bit
    if (fast and plan[0] is not None and not state.is_conj()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))):
        y = empty_like(x)
        if plan[0](*ts, y):
            account(f"samu_step_{layout}", (*ts[:3], *((nu_log, theta_log) if modes is None else (modes,)), state,
                                            reset), (state, y))
            return y
    no_grad_inputs(name or layout, _GRAD_NAMES, (x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log,
                                                 state))
    if fast:
        _step_kernel.last = None
    launch = torch.ops.kernels.samu_step if torch.compiler.is_compiling() else _launch
    y = launch(layout, x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, state, reset, modes, block_m, block_d,
               num_warps)
    if fast and plan[0] is None:
        plan[0] = replay(_step_kernel, (*ts, y))
    return y


_GRAD_NAMES = ("x", "phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log", "state")


def samu_step_row(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state, reset=None, modes=None,
                  block_m=None, block_d=None, num_warps=None, plan=None):
    """Decode step (kernels.ops.samu_step's contract), one program per sequence walking its modes in blocks of
    `block_m` (default ROW_DEFAULT_BLOCK_M), its controller reduction in `block_d` columns (default _row_block_d),
    with `num_warps` warps (default 8)."""
    return _step("row", x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state, reset, modes,
                 block_m=0 if block_m is None else check_pow2("block_m", block_m, 16, ROW_BLOCK_M),
                 block_d=0 if block_d is None else check_pow2("block_d", block_d, 16, ROW_BLOCK_D),
                 num_warps=0 if num_warps is None else check_pow2("num_warps", num_warps, 1, 16), plan=plan)


def samu_step_blocked(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state, reset=None,
                      modes=None, block_m=None, num_warps=None, plan=None):
    """Decode step, one program per (sequence, `block_m` modes: default 128) with `num_warps` warps (default 4),
    each reducing its row's controller. Same contract as samu_step_row."""
    return _step("blocked", x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state, reset, modes,
                 block_m=0 if block_m is None else check_pow2("block_m", block_m, 16, ROW_BLOCK_M),
                 num_warps=0 if num_warps is None else check_pow2("num_warps", num_warps, 1, 16), plan=plan)


def samu_step(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state, reset=None, modes=None,
              plan=None):
    """Decode step with the layout measured fastest for the batch size (see ROW_MIN_BATCH)."""
    check_tensor("x", x, ndim=2)
    layout = "row" if x.shape[0] >= (ROW_MIN_BATCH if modes is None else ROW_MIN_BATCH_TABLE) else "blocked"
    return _step(layout, x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state, reset, modes,
                 "fused", plan=plan)
