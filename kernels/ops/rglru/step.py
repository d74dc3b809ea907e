"""One-launch RG-LRU decode step: both gate matvecs, the transition, the write and the
in-place FP32 state update. Program (j, i) owns BJ output channels of one gate block (width
W = D / H) for BB rows, the matvecs in slices of BK. CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..accounting import account
from ..checks import no_grad_inputs
from ..triton_utils import INTERPRET, cdiv, empty_like, launcher, next_pow2, out, replay, tl_acc
from .common import one_minus_sq, softplus


@triton.jit
def _matvec_acc(acc, xt, wt, MODE: tl.constexpr, ACC: tl.constexpr):
    # MODE 0: tensor cores on bf16/fp16 operands (exact products, FP32 sums);
    # 1: FP32 operands in IEEE FP32; 2: float64 by broadcast products.
    if MODE == 0:
        return tl.dot(xt, wt, acc)
    elif MODE == 1:
        return tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
    else:
        return acc + tl.sum(xt.to(ACC)[:, :, None] * wt.to(ACC)[None, :, :], axis=1)


@launcher
@triton.jit
def rglru_step_kernel(x, wx, bx, wa, ba, ap, state, reset, y, B, D, W, HAS_RESET: tl.constexpr, MODE: tl.constexpr,
                      BB: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr, RNE: tl.constexpr):
    pid_j, pid_b = tl.program_id(0), tl.program_id(1)
    NJ = tl.cdiv(W, BJ)
    blk = pid_j // NJ
    o_j = (pid_j % NJ) * BJ + tl.arange(0, BJ)
    m_j = o_j < W
    o_b = pid_b * BB + tl.arange(0, BB)
    m_b = o_b < B
    row = o_b.to(tl.int64)[:, None] * D
    # [BB, BJ]
    accx = tl.zeros([BB, BJ], ACC)
    acca = tl.zeros([BB, BJ], ACC)
    for k0 in range(0, W, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < W
        xt = tl.load(x + row + blk * W + o_k[None, :], mask=m_b[:, None] & m_k[None, :], other=0.0)
        w_off = (blk * W + o_k[:, None]).to(tl.int64) * W + o_j[None, :]
        m_w = m_k[:, None] & m_j[None, :]
        accx = _matvec_acc(accx, xt, tl.load(wx + w_off, mask=m_w, other=0.0), MODE, ACC)
        acca = _matvec_acc(acca, xt, tl.load(wa + w_off, mask=m_w, other=0.0), MODE, ACC)
    d = blk * W + o_j
    sx = tl.sigmoid(accx + tl.load(bx + d, mask=m_j, other=0.0).to(ACC)[None, :])
    sa = tl.sigmoid(acca + tl.load(ba + d, mask=m_j, other=0.0).to(ACC)[None, :])
    sp = softplus(tl.load(ap + d, mask=m_j, other=0.0).to(ACC))
    log_a = -8.0 * sa * sp[None, :]
    a = tl.exp(log_a)
    mult = tl.sqrt(one_minus_sq(a, log_a))
    if HAS_RESET:
        rst = (tl.load(reset + o_b, mask=m_b, other=0) != 0)[:, None]
        a = tl.where(rst, 0.0, a)
        mult = tl.where(rst, 1.0, mult)
    m = m_b[:, None] & m_j[None, :]
    off = row + d[None, :]
    xd = tl.load(x + off, mask=m, other=0.0).to(ACC)
    h = a * tl.load(state + off, mask=m, other=0.0) + xd * sx * mult
    tl.store(state + off, h, mask=m)
    tl.store(y + off, out(h, y, RNE), mask=m)


def _mode(x, w):
    if x.dtype == torch.float64 or w.dtype == torch.float64:
        return 2
    # The CPU interpreter multiplies BF16 bit patterns as integers in tl.dot: FP32 there
    # (the same products, exact in FP32 either way).
    if x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16) and not INTERPRET:
        return 0
    return 1


def rglru_step(x, gate_x_w, gate_x_b, gate_a_w, gate_a_b, a_param, state, reset=None,
               block_b=None, block_j=32, block_k=32, num_warps=4, plan=None):
    """kernels.ops.rglru_step's contract (state contiguous); under torch.compile the custom
    op kernels::rglru_step. No backward: an input requiring grad raises ValueError. `plan`:
    a one-item list private to one checked call signature (kernels.ops keeps it), holding
    that signature's replayed launch (triton_utils.replay) for calls with no input requiring grad."""
    ts = (x, gate_x_w, gate_x_b, gate_a_w, gate_a_b, a_param, state, state if reset is None else reset)
    fast = plan is not None and not INTERPRET and not torch.compiler.is_compiling()
    # the plan's signature fixes each tensor's strides: contiguous where the plan exists
    if fast and plan[0] is not None and not (torch.is_grad_enabled() and any(t.requires_grad for t in ts)):
        y = empty_like(x)
        if plan[0](*ts, y):
            account("rglru_step", ts if reset is not None else ts[:-1], (state, y))
            return y
    no_grad_inputs("fused", ("x", "gate_x_w", "gate_x_b", "gate_a_w", "gate_a_b", "a_param", "state"), ts[:7])
    if fast:
        rglru_step_kernel.last = None
    step = torch.ops.kernels.rglru_step if torch.compiler.is_compiling() else _launch
    y = step(x, gate_x_w, gate_x_b, gate_a_w, gate_a_b, a_param, state, reset, block_b or 0, block_j, block_k,
             num_warps)
    if fast and plan[0] is None:
        plan[0] = replay(rglru_step_kernel, (*ts, y))
    return y


def _launch(x: Tensor, gate_x_w: Tensor, gate_x_b: Tensor, gate_a_w: Tensor, gate_a_b: Tensor, a_param: Tensor,
            state: Tensor, reset: Optional[Tensor], block_b: int, block_j: int, block_k: int, num_warps: int) -> Tensor:
    B, D = x.shape
    H, W, _ = gate_x_w.shape
    if not state.is_contiguous():
        raise ValueError("expected a contiguous state (it is updated in place), got a strided view")
    if gate_a_w.dtype != gate_x_w.dtype:
        raise ValueError(f"expected gate_x_w and gate_a_w of one dtype, got {gate_x_w.dtype} and {gate_a_w.dtype}")
    # the kernel indexes every input as contiguous: strided views are copied
    x, a_param = x.contiguous(), a_param.contiguous()
    wx, bx, wa, ba = gate_x_w.contiguous(), gate_x_b.contiguous(), gate_a_w.contiguous(), gate_a_b.contiguous()
    mode = _mode(x, wx)
    bb = block_b or min(64, max(16, next_pow2(B)))
    if mode == 2:
        bb, block_j, block_k = min(bb, 16), min(block_j, 16), min(block_k, 16)
    y = empty_like(x)
    rst = reset.contiguous().view(torch.uint8) if reset is not None else None
    rglru_step_kernel[(H * cdiv(W, block_j), cdiv(B, bb))](
        x, wx, bx, wa, ba, a_param, state, rst if rst is not None else state, y, B, D, W,
        HAS_RESET=reset is not None, MODE=mode, BB=bb, BJ=block_j, BK=block_k, ACC=tl_acc(state.dtype),
        RNE=INTERPRET, num_warps=num_warps)
    account("rglru_step", (x, wx, bx, wa, ba, a_param, state, rst), (state, y))
    return y


# the launcher itself as the custom op (block_b 0: chosen from B)
torch.library.custom_op("kernels::rglru_step", _launch, mutates_args=("state",)).register_fake(
    lambda x, *args: torch.empty_like(x))
