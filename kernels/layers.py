"""nn.Modules of the Hawk model: norms, projections, the causal convolution and the
two recurrent mixers (RG-LRU, SAMU), assembled into recurrent, MLP and residual blocks.

Notation: B batch, T time, D model width, E recurrent width, M = E / 2 SAMU modes,
H gate blocks, W = 4 convolution width. Semantics and parameter layout follow the official
`recurrentgemma.torch` (kernels.convert), except that the convolution's decode cache drops
inputs before a document start, so decoding through a boundary matches the full forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .ops.checks import check_segment_pos, check_tensor, no_grad_inputs, state_dtype

MIXERS = ("rglru", "samu")


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation (what the official code uses)."""
    return F.gelu(x, approximate="tanh")


def _fused_gelu(*ts: torch.Tensor) -> bool:
    """Whether the gated GeLU runs fused (kernels.ops.geglu): on CUDA, eager, one 16-bit or
    FP32 dtype; compiled, inductor fuses the formula itself."""
    if not ts[0].is_cuda or torch.compiler.is_compiling():
        return False
    from .ops.geglu import DTYPES    # imports triton

    return all(t.dtype == ts[0].dtype for t in ts) and ts[0].dtype in DTYPES


def gelu_mul(gate: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * value: one fused pass each way where _fused_gelu, else the formula."""
    if _fused_gelu(gate, value) and gate.shape == value.shape:
        from .ops.geglu import gelu_mul as fused    # imports triton

        return fused(gate.contiguous(), value.contiguous())
    return gelu(gate) * value


def _init_normal(w: torch.Tensor, b: torch.Tensor, variance_scale: float, fan_in: int) -> None:
    """The official initialisation: w ~ N(0, variance_scale / fan_in), b = 0."""
    nn.init.normal_(w, std=math.sqrt(variance_scale / fan_in))
    nn.init.zeros_(b)


@dataclass
class RecurrentCache:
    """Decode cache of one recurrent block: conv_state [B, W - 1, E] (the last conv inputs,
    oldest first), rnn_state [B, E] FP32 (RG-LRU) or [B, M] complex64 (SAMU; float64 models:
    float64 / complex128). `forward` returns a new cache; `step` updates it in place."""

    conv_state: torch.Tensor
    rnn_state: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.rnn_state.shape[0]


class RMSNorm(nn.Module):
    """x / rms(x) * (1 + scale); `scale` starts at zero. Computed in at least FP32."""

    def __init__(self, width: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.width, self.eps = width, eps
        self.scale = nn.Parameter(torch.zeros(width, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(acc), (self.width,), self.scale.to(acc) + 1, self.eps).to(x.dtype)


def _autocast_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype where autocast narrows these wider weights (eager only: compiled,
    the plain formula is what inductor fuses), else None."""
    dev = x.device.type
    if torch.compiler.is_compiling() or not torch.is_autocast_enabled(dev):
        return None
    dt = torch.get_autocast_dtype(dev)
    return dt if w.dtype != dt else None


class _BlockDiagonalNarrow(torch.autograd.Function):
    """Block-diagonal linears sharing their input x, in autocast's narrow dtype:
    `(einsum(x, w) + b).to(x.dtype)`, b added in its wider dtype. Each batched GEMM writes
    its [N, H, j] output through an [H, N, j] view (cuBLAS takes the leading dimension H * j
    as is), so no copy is made; the backward writes one dx for all linears the same way."""

    @staticmethod
    def forward(ctx, x, *wb):
        ws, bs = wb[0::2], wb[1::2]
        H, i = ws[0].shape[:2]
        xh = x.reshape(-1, H, i).transpose(0, 1)                  # [H, N, i], a view
        outs = []
        for w, b in zip(ws, bs):
            out = torch.empty(xh.shape[1], H, w.shape[2], dtype=x.dtype, device=x.device)
            torch.bmm(xh, w, out=out.transpose(0, 1))
            outs.append(out.add_(b).view(*x.shape[:-1], -1))
        ctx.save_for_backward(x, *ws)
        ctx.b_dtypes = [b.dtype for b in bs]
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        x, *ws = ctx.saved_tensors
        H, i = ws[0].shape[:2]
        xh = x.reshape(-1, H, i).transpose(0, 1)
        dx, grads = None, []
        for k, (g, w, b_dtype) in enumerate(zip(gs, ws, ctx.b_dtypes)):
            if g is None:
                grads += [None, None]
                continue
            gh = g.reshape(xh.shape[1], H, -1).transpose(0, 1)    # [H, N, j]
            if ctx.needs_input_grad[0]:
                wt = w.transpose(1, 2)
                if dx is None:
                    dx = torch.empty(xh.shape[1], H, i, dtype=x.dtype, device=x.device)
                    torch.bmm(gh, wt, out=dx.transpose(0, 1))
                else:
                    dx.transpose(0, 1).baddbmm_(gh, wt)
            grads += [torch.bmm(xh.transpose(1, 2), gh) if ctx.needs_input_grad[1 + 2 * k] else None,
                      gh.sum(1, dtype=b_dtype) if ctx.needs_input_grad[2 + 2 * k] else None]
        return (None if dx is None else dx.view(x.shape), *grads)


def block_diagonal(x: torch.Tensor, *linears: "BlockDiagonalLinear") -> tuple[torch.Tensor, ...]:
    """Each of `linears` applied to x; under autocast (eager) in one autograd node."""
    dt = _autocast_dtype(x, linears[0].w)
    if dt is None:
        return tuple(m(x) for m in linears)
    return _BlockDiagonalNarrow.apply(x.to(dt), *[t for m in linears for t in (m.w.to(dt), m.b)])


class BlockDiagonalLinear(nn.Module):
    """H independent W x W linear maps on the H blocks of the last axis (E = H * W).
    Official layout: w [H, W, W] (input index first), b [H, W]."""

    def __init__(self, width: int, num_blocks: int, w_init_variance_scale: float = 1.0, device=None, dtype=None):
        super().__init__()
        if num_blocks < 1 or width % num_blocks:
            raise ValueError(f"expected num_blocks dividing width = {width}, got {num_blocks}")
        self.num_blocks, self.block_width = num_blocks, width // num_blocks
        self.w_init_variance_scale = w_init_variance_scale
        self.w = nn.Parameter(torch.empty(num_blocks, self.block_width, self.block_width, device=device, dtype=dtype))
        self.b = nn.Parameter(torch.empty(num_blocks, self.block_width, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_normal(self.w, self.b, self.w_init_variance_scale, self.block_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _autocast_dtype(x, self.w) is not None:
            return block_diagonal(x, self)[0]
        xs = x.unflatten(-1, (self.num_blocks, self.block_width))      # [..., H, W]
        y = torch.einsum("...hi,hij->...hj", xs, self.w)
        # compiled under autocast y is narrow and b wide: their sum rounded once to y's dtype
        return (y + self.b).to(y.dtype).flatten(-2)


class Conv1D(nn.Module):
    """Depthwise causal convolution over time, width W, with bias: output t sums
    w[W-1-s] * x[t-s] over s < W, leaving out x[t-s] before a document start in (t-s, t].
    w: [W, E], b: [E]. On CUDA without a cache in or out it runs ops.conv.causal_conv1d."""

    def __init__(self, width: int, temporal_width: int = 4, w_init_variance_scale: float = 0.01,
                 device=None, dtype=None):
        super().__init__()
        self.width, self.temporal_width = width, temporal_width
        self.w_init_variance_scale = w_init_variance_scale
        self.w = nn.Parameter(torch.empty(temporal_width, width, device=device, dtype=dtype))
        self.b = nn.Parameter(torch.empty(width, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_normal(self.w, self.b, self.w_init_variance_scale, self.temporal_width)

    def init_cache(self, batch: int, dtype=None, device=None) -> torch.Tensor:
        return torch.zeros(batch, self.temporal_width - 1, self.width, dtype=dtype or self.w.dtype,
                           device=device or self.w.device)

    def forward(self, x: torch.Tensor, segment_pos: torch.Tensor | None, cache: torch.Tensor | None = None,
                return_cache: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [B, T, E]; segment_pos: [B, T] or None; cache: [B, W-1, E], the inputs before x.
        Returns (y [B, T, E], new cache or None)."""
        B, T, _ = x.shape
        check_segment_pos(segment_pos, B, T)
        if cache is None and not return_cache and x.is_cuda:
            from .ops.conv import causal_conv1d    # imports triton

            return causal_conv1d(x.contiguous(), self.w.contiguous(), self.b.contiguous(), segment_pos), None
        W = self.temporal_width
        acc = torch.promote_types(x.dtype, torch.float32)
        if cache is not None:
            check_tensor("conv_state", cache, shape=(B, W - 1, self.width))
        prev = x.new_zeros(B, W - 1, self.width, dtype=acc) if cache is None else cache.to(acc)
        xp = torch.cat([prev, x.to(acc)], dim=1)                       # [B, W-1+T, E]
        keep = torch.ones(B, T, dtype=acc, device=x.device)            # shift-s mask
        not_start = keep if segment_pos is None else (segment_pos != 0).to(acc)    # [B, T]
        w = self.w.to(acc)
        y = xp[:, W - 1:] * w[W - 1]
        # the cache: what output T-1 reads at each shift s < W-1, masked the same way, so
        # that inputs before a document start never reach a later decode step
        last = [xp[:, -1]]
        for s in range(1, W):
            # x[t-s] is kept iff no document starts at t-s+1 .. t.
            keep = keep * F.pad(not_start[:, : max(T - s + 1, 0)], (s - 1, 0), value=1.0)[:, :T]
            window = xp[:, W - 1 - s: W - 1 - s + T]
            # (window * w) * keep: autograd then keeps only views of xp and the small mask.
            y = y + (window * w[W - 1 - s]) * keep[..., None]
            if s < W - 1:
                last.append(window[:, T - 1] * keep[:, T - 1, None])
        y = (y + self.b.to(acc)).to(x.dtype)
        if not return_cache:
            return y, None
        return y, torch.stack(last[W - 2::-1], dim=1).to(x.dtype if cache is None else cache.dtype)

    def step(self, x: torch.Tensor, conv_state: torch.Tensor, reset: torch.Tensor | None = None) -> torch.Tensor:
        """One token. x: [B, E]; conv_state: [B, W-1, E], updated in place; reset: [B] bool.
        Returns y [B, E]."""
        check_tensor("conv_state", conv_state, shape=(x.shape[0], self.temporal_width - 1, self.width))
        acc = torch.promote_types(x.dtype, torch.float32)
        window = torch.cat([conv_state.to(acc), x.to(acc)[:, None]], dim=1)   # [B, W, E]
        if reset is not None:
            keep = (~reset).to(acc)[:, None, None]
            window = torch.cat([window[:, :-1] * keep, window[:, -1:]], dim=1)
        y = (window * self.w.to(acc)).sum(dim=1) + self.b.to(acc)
        with torch.no_grad():
            conv_state.copy_(window[:, 1:].to(conv_state.dtype))
        return y.to(x.dtype)


def rnn_param_init(param: torch.Tensor, min_rad: float = 0.9, max_rad: float = 0.999,
                   eps: float = 1e-8) -> torch.Tensor:
    """Official RG-LRU initialisation: r = exp(-softplus(a_param)) uniform by area on the
    ring [min_rad, max_rad]."""
    with torch.no_grad():
        param.uniform_(min_rad**2 + eps, max_rad**2 + eps)
        param.log_().mul_(0.5)
        return param.neg_().exp_().sub_(1.0).log_()


class Mixer(nn.Module):
    """A recurrent mixer running the op `OP` with `backend` and its decode step with
    `step_backend` (set_backend); subclasses give `_inputs(x)` and `step_params()`."""

    OP = ""
    COMPLEX_STATE = False

    def __init__(self, width: int, state_width: int, backend):
        super().__init__()
        self.width, self.state_width = width, state_width
        set_backend(self, backend)

    def init_cache(self, batch: int, dtype=None, device=None) -> torch.Tensor:
        """Zero recurrent state [B, state_width] (layouts: RecurrentCache)."""
        p = next(self.parameters())
        return torch.zeros(batch, self.state_width, dtype=state_dtype(dtype or p.dtype, self.COMPLEX_STATE),
                           device=device or p.device)

    def forward(self, x: torch.Tensor, segment_pos: torch.Tensor | None, cache: torch.Tensor | None = None,
                return_cache: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [B, T, E]; cache: the state before x. Returns (y, final state or None)."""
        return getattr(ops, self.OP)(*self._inputs(x), segment_pos, cache, return_cache, backend=self.backend)

    def step(self, x: torch.Tensor, state: torch.Tensor, reset: torch.Tensor | None = None, **kw) -> torch.Tensor:
        """One token. x: [B, E]; state updated in place; kw: SAMU's modes (decode_modes)."""
        return getattr(ops, f"{self.OP}_step")(x, *self.step_params(), state, reset, backend=self.step_backend, **kw)


class RGLRU(Mixer):
    """Real-Gated Linear Recurrent Unit (SPEC 1.1) with official parameter names:
    a_param [E], input_gate / a_gate BlockDiagonalLinear with H blocks."""

    OP = "rglru"

    def __init__(self, width: int, num_heads: int, w_init_variance_scale: float = 1.0,
                 backend="auto", device=None, dtype=None):
        super().__init__(width, width, backend)
        self.num_heads, self.w_init_variance_scale = num_heads, w_init_variance_scale
        self.a_param = nn.Parameter(torch.empty(width, device=device, dtype=dtype))
        self.input_gate = BlockDiagonalLinear(width, num_heads, w_init_variance_scale, device, dtype)
        self.a_gate = BlockDiagonalLinear(width, num_heads, w_init_variance_scale, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.input_gate.reset_parameters()
        self.a_gate.reset_parameters()
        rnn_param_init(self.a_param)

    def _inputs(self, x):
        gate_x, gate_a = (g.to(x.dtype) for g in block_diagonal(x, self.input_gate, self.a_gate))
        return x, gate_x, gate_a, self.a_param

    def step_params(self):
        return self.input_gate.w, self.input_gate.b, self.a_gate.w, self.a_gate.b, self.a_param


class SAMU(Mixer):
    """Shared-control complex diagonal recurrence (SPEC 1.2) of M = E / 2 modes; the last
    entry of phase_dir and radial_dir is a bias. Initialisation as SPEC 1.2 states."""

    OP = "samu"
    COMPLEX_STATE = True

    def __init__(self, width: int, backend="auto", device=None, dtype=None):
        if width % 2:
            raise ValueError(f"expected an even width for SAMU (M = width / 2 complex modes), got {width}")
        super().__init__(width, width // 2, backend)
        shapes = {"nu_log": width // 2, "theta_log": width // 2, "phase_dir": width + 1, "radial_dir": width + 1,
                  "phase_amp": (), "radial_amp": ()}
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            lo, hi = 0.9**2, 0.999**2
            u = torch.rand_like(self.nu_log)
            # |a| = exp(-nu) at eta = 0, uniform by area on the ring [0.9, 0.999].
            self.nu_log.copy_(torch.log(-0.5 * torch.log(u * (hi - lo) + lo)))
            self.theta_log.copy_(torch.log(torch.rand_like(self.theta_log).clamp_min(1e-12) * math.pi / 10))
            for d, amp in ((self.phase_dir, self.phase_amp), (self.radial_dir, self.radial_amp)):
                nn.init.normal_(d, std=1.0 / math.sqrt(self.width))
                d[-1] = 0.0
                amp.fill_(0.5)

    def _inputs(self, x):
        return x, *self.step_params()

    def step_params(self):
        return self.phase_dir, self.radial_dir, self.phase_amp, self.radial_amp, self.nu_log, self.theta_log

    def decode_modes(self, dtype: torch.dtype) -> torch.Tensor | None:
        """`step(..., modes=)` for inputs of `dtype` until the parameters change: the mode
        table the Triton steps read, None where the steps run the reference."""
        if ops.step_has_backward("samu", self.step_backend, self.nu_log.device):
            return None
        return ops.samu_mode_table(self.nu_log, self.theta_log, dtype)


def set_backend(module: nn.Module, backend, step_backend=None) -> nn.Module:
    """Select the kernels of every mixer in `module`: `backend` for sequences, `step_backend`
    for decode steps (names, "auto" or Backends; default "reference" with a "reference"
    backend, else "auto" with `backend`'s table, which picks the step per batch size)."""
    backend = ops.Backend.of(backend)
    if step_backend is None:
        step_backend = "reference" if backend.name == "reference" else ops.Backend("auto", table=backend.table)
    step_backend = ops.Backend.of(step_backend)
    for m in module.modules():
        if isinstance(m, Mixer):
            m.backend, m.step_backend = backend, step_backend
    return module


def make_mixer(mixer: str, width: int, num_heads: int, backend="auto", device=None, dtype=None) -> Mixer:
    if mixer not in MIXERS:
        raise ValueError(f"expected mixer in {list(MIXERS)}, got {mixer!r}")
    kw = dict(backend=backend, device=device, dtype=dtype)
    return RGLRU(width, num_heads, **kw) if mixer == "rglru" else SAMU(width, **kw)


class RecurrentBlock(nn.Module):
    """Hawk's temporal block: out = Linear_out(Mixer(Conv1D(Linear_x(x))) * gelu(Linear_y(x))).
    The mixer sub-module is named `rg_lru` or `samu` (official state-dict names for RG-LRU)."""

    def __init__(self, width: int, num_heads: int, lru_width: int | None = None, mixer: str = "rglru",
                 conv1d_temporal_width: int = 4, final_w_init_variance_scale: float = 1.0,
                 backend="auto", device=None, dtype=None):
        super().__init__()
        self.width, self.num_heads, self.mixer_name = width, num_heads, mixer
        self.lru_width = E = lru_width or width
        self.conv1d_temporal_width = conv1d_temporal_width
        self.final_w_init_variance_scale = final_w_init_variance_scale
        self.linear_y = nn.Linear(width, E, device=device, dtype=dtype)
        self.linear_x = nn.Linear(width, E, device=device, dtype=dtype)
        self.linear_out = nn.Linear(E, width, device=device, dtype=dtype)
        self.conv_1d = Conv1D(E, conv1d_temporal_width, device=device, dtype=dtype)
        setattr(self, "rg_lru" if mixer == "rglru" else "samu", make_mixer(mixer, E, num_heads, backend, device, dtype))
        self.reset_parameters()

    @property
    def mixer(self) -> Mixer:
        return self.rg_lru if self.mixer_name == "rglru" else self.samu

    def reset_parameters(self) -> None:
        for lin in (self.linear_x, self.linear_y):
            _init_normal(lin.weight, lin.bias, 1.0, self.width)
        _init_normal(self.linear_out.weight, self.linear_out.bias, self.final_w_init_variance_scale, self.lru_width)
        self.conv_1d.reset_parameters()
        self.mixer.reset_parameters()

    def init_cache(self, batch: int, dtype=None, device=None) -> RecurrentCache:
        return RecurrentCache(self.conv_1d.init_cache(batch, dtype, device),
                              self.mixer.init_cache(batch, dtype, device))

    def forward(self, x: torch.Tensor, segment_pos: torch.Tensor, cache: RecurrentCache | None = None,
                return_cache: bool = True) -> tuple[torch.Tensor, RecurrentCache | None]:
        """x: [B, T, D]; segment_pos: [B, T]. Returns (out [B, T, D], new cache or None)."""
        conv_state, rnn_state = (None, None) if cache is None else (cache.conv_state, cache.rnn_state)
        y = self.linear_y(x)
        xb, conv_state = self.conv_1d(self.linear_x(x), segment_pos, conv_state, return_cache)
        xb, rnn_state = self.mixer(xb, segment_pos, rnn_state, return_cache)
        return self.linear_out(gelu_mul(y, xb)), (RecurrentCache(conv_state, rnn_state) if return_cache else None)

    def step(self, x: torch.Tensor, cache: RecurrentCache, reset: torch.Tensor | None = None,
             **mixer_kw) -> torch.Tensor:
        """One token. x: [B, D]; cache updated in place; mixer_kw: SAMU's modes. With a
        Triton mixer step (no backward) an input or parameter requiring grad under grad mode
        raises ValueError before any cache tensor changes."""
        step = self.mixer.step_backend
        if torch.is_grad_enabled() and not ops.step_has_backward(self.mixer_name, step, x.device):
            params = dict(self.named_parameters())
            no_grad_inputs(step.name, ("x", *params), (x, *params.values()))
        y = self.linear_y(x)
        xb = self.conv_1d.step(self.linear_x(x), cache.conv_state, reset)
        xb = self.mixer.step(xb, cache.rnn_state, reset, **mixer_kw)
        return self.linear_out(gelu_mul(y, xb))


class MLPBlock(nn.Module):
    """Gated GeLU MLP: ffw_down(gelu(gate) * value), gate and value the halves of one
    Linear(D, 2 * expanded) `ffw_up`; fused where _fused_gelu."""

    def __init__(self, width: int, expanded_width: int, final_w_init_variance_scale: float = 1.0,
                 device=None, dtype=None):
        super().__init__()
        self.width, self.expanded_width = width, expanded_width
        self.final_w_init_variance_scale = final_w_init_variance_scale
        self.ffw_up = nn.Linear(width, 2 * expanded_width, device=device, dtype=dtype)
        self.ffw_down = nn.Linear(expanded_width, width, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_normal(self.ffw_up.weight, self.ffw_up.bias, 1.0, self.width)
        _init_normal(self.ffw_down.weight, self.ffw_down.bias, self.final_w_init_variance_scale, self.expanded_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.ffw_up(x)
        if _fused_gelu(up):
            from .ops.geglu import geglu    # imports triton

            return self.ffw_down(geglu(up.contiguous()))
        gate, value = up.chunk(2, dim=-1)
        return self.ffw_down(gelu(gate) * value)


class ResidualBlock(nn.Module):
    """x + Temporal(RMSNorm(x)), then + MLP(RMSNorm(.)) (Hawk: the temporal block is recurrent)."""

    def __init__(self, width: int, mlp_expanded_width: int, num_heads: int, lru_width: int | None = None,
                 mixer: str = "rglru", conv1d_temporal_width: int = 4, final_w_init_variance_scale: float = 1.0,
                 backend="auto", device=None, dtype=None):
        super().__init__()
        self.temporal_pre_norm = RMSNorm(width, device=device, dtype=dtype)
        self.recurrent_block = RecurrentBlock(width, num_heads, lru_width, mixer, conv1d_temporal_width,
                                              final_w_init_variance_scale, backend, device, dtype)
        self.channel_pre_norm = RMSNorm(width, device=device, dtype=dtype)
        self.mlp_block = MLPBlock(width, mlp_expanded_width, final_w_init_variance_scale, device, dtype)

    def forward(self, x: torch.Tensor, segment_pos: torch.Tensor, cache: RecurrentCache | None = None,
                return_cache: bool = True) -> tuple[torch.Tensor, RecurrentCache | None]:
        """x: [B, T, D]; segment_pos: [B, T]. Returns (x [B, T, D], new cache or None)."""
        h, cache = self.recurrent_block(self.temporal_pre_norm(x), segment_pos, cache, return_cache)
        residual = h + x
        return self.mlp_block(self.channel_pre_norm(residual)) + residual, cache

    def step(self, x: torch.Tensor, cache: RecurrentCache, reset: torch.Tensor | None = None,
             **mixer_kw) -> torch.Tensor:
        """One token. x: [B, D]; cache updated in place; mixer_kw as RecurrentBlock.step's."""
        residual = self.recurrent_block.step(self.temporal_pre_norm(x), cache, reset, **mixer_kw) + x
        return self.mlp_block(self.channel_pre_norm(residual)) + residual


__all__ = ["RMSNorm", "BlockDiagonalLinear", "Conv1D", "Mixer", "RGLRU", "SAMU", "RecurrentBlock", "MLPBlock",
           "ResidualBlock", "RecurrentCache", "gelu", "rnn_param_init", "make_mixer", "MIXERS"]
