"""What the measuring stages time: op and decode-step inputs, the timed calls, the
gates before timing, the memory floor's bytes, backend variants and the peers.
Legend: B batch, T time, D width (M = D / 2 complex modes for SAMU), H heads."""

import fnmatch
import inspect
import itertools

import torch

import kernels
import parity
from kernels import layers, ops
from kernels.models.generation import Engine

from .measure import Skip, logical_counts

OPS = ("rglru", "samu", "scan")
STEP_OPS = ("rglru", "samu")
SCAN_PEERS = ("fla_fused_recurrent_hgrn", "accelerated_scan_triton", "accelerated_scan_warp")
# Arguments of the decode steps that are not launcher options.
STEP_FIXED = {
    "rglru": {"x", "gate_x_w", "gate_x_b", "gate_a_w", "gate_a_b", "a_param", "state", "reset"},
    "samu": {"x", "phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log", "state", "reset"},
}


def positions(B: int, T: int, device, resets: bool = False):
    """segment_pos [B, T]: one document per row, or with `resets` the audit's mix of resets."""
    return (parity.make_segment_pos(B, T, resets=True, seed=0, device=device) if resets
            else torch.arange(T, device=device).expand(B, T).contiguous())


def op_inputs(op: str, B: int, T: int, D: int, dtype, device, requires_grad=False, resets=False) -> list:
    """Positional arguments of `op`: activations [B, T, D] in `dtype`, FP32 parameters, segment_pos."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def act():
        return torch.randn(B, T, D, generator=g).to(device=device, dtype=dtype).requires_grad_(requires_grad)

    pos = positions(B, T, device, resets)
    torch.manual_seed(0)
    if op == "rglru":
        a_param = layers.rnn_param_init(torch.empty(D, device=device)).requires_grad_(requires_grad)
        return [act(), act(), act(), a_param, pos, None, False]
    if op == "samu":
        m = layers.SAMU(D, device=device)
        return [act(), *[p.detach().clone().requires_grad_(requires_grad) for p in m.step_params()], pos, None, False]
    if op == "scan":
        a = (torch.rand(B, T, D, generator=g) * 0.099 + 0.9).to(device=device, dtype=dtype)
        return [a.requires_grad_(requires_grad), act(), pos, None, False]
    raise ValueError(f"expected op in {list(OPS)}, got {op!r}")


def step_inputs(op: str, B: int, D: int, heads: int, dtype, device, seed: int = 0) -> tuple[list, object]:
    """(arguments without the state, zero state) of a decode step at `dtype` weights."""
    if op not in STEP_OPS:
        raise ValueError(f"expected op in {list(STEP_OPS)}, got {op!r}")
    torch.manual_seed(seed)
    x = torch.randn(B, D, device=device, dtype=dtype)
    kw = {"device": device, "dtype": dtype}
    m = layers.RGLRU(D, heads, **kw) if op == "rglru" else layers.SAMU(D, **kw)
    return [a.detach() for a in (x, *m.step_params())], m.init_cache(B, dtype, device)


def step_counts(engine: Engine, B: int, device) -> dict:
    """Logical counts of one decode step of `engine` (started at batch size B); a graph replay runs
    no launcher code, so an eager twin with the same kernels and tiles is counted."""
    if not engine.graphs:
        engine.step()
        return logical_counts(engine.step, device)
    twin = Engine(engine.model, kernels=engine.kernels, graphs=False, pdl=engine.pdl,
                  linear_configs=engine.linear_configs)
    twin.start(batch_size=B)
    twin.step()
    logical = logical_counts(twin.step, device)
    logical["launches_method"] += " (eager twin of the graph-captured step)"
    return logical


def nbytes(tensors) -> int:
    """Bytes of the floating-point and complex tensors (integer positions only encode resets)."""
    return sum(t.numel() * t.element_size() for t in tensors
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))


def floor_bytes(args: list, out, mode: str = "fwd") -> int:
    """The memory floor's bytes: inputs read, output written; for "fwd_bwd" also the output's
    gradient read, the inputs read again and their gradients written."""
    return nbytes(args) * (1 if mode == "fwd" else 3) + nbytes([out]) * (1 if mode == "fwd" else 2)


def chunk_variants(name: str, fn, chunk_sizes) -> list[dict]:
    """One option set per chunk size for a chunked backend taking chunk_size, else [{}]."""
    return option_grid(fn, name, {name: {"chunk_size": chunk_sizes}}) if "chunk" in name else [{}]


def option_grid(fn, name: str, grids: dict, fixed: set[str] = frozenset(), op: str | None = None) -> list[dict]:
    """Every combination of the launcher's options (outside `fixed`) in the grid for "op/name", else
    "name", else "*"; a list of grids (options that only go together) gives their union."""
    found = grids.get(f"{op}/{name}", grids.get(name, grids.get("*", {})))
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out = []
    for grid in found if isinstance(found, list) else [found]:
        space = {k: v for k, v in grid.items() if (k in params and k not in fixed) or (var_kw and k not in params)}
        out += [opts for opts in combos(space) if opts not in out]
    return out or [{}]


def combos(grid: dict) -> list[dict]:
    keys = sorted(grid)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(grid[k] for k in keys))]


def step_option_sets(grids: dict) -> dict[str, list[dict]]:
    """{"op/backend": option sets} of every decode step launcher the grids (tune.decode.options) name."""
    out = {}
    for op in STEP_OPS:
        for name, fn in ops.step_backends(op).items():
            # option_grid gives [{}] where no grid names the launcher
            if sets := [o for o in option_grid(fn, name, grids, STEP_FIXED[op], op) if o]:
                out[f"{op}/{name}"] = sets
    return out


def opt_tag(opts: dict) -> str:
    short = {"chunk_size": "K", "num_warps": "w", "block_d": "bd", "block_m": "bm", "num_stages": "s"}
    return "".join(f"-{short.get(k, k)}{v}" for k, v in sorted(opts.items()))


def rel_err(got, want) -> float:
    g, w = (torch.view_as_real(t.resolve_conj()).double() if t.is_complex() else t.double() for t in (got, want))
    scale, err = (w.abs().max().item(), (g - w).abs().max().item()) if w.numel() else (0.0, 0.0)
    return err / scale if scale > 0 else err


def checked(errs: dict, tol: float) -> dict:
    """`errs` ({check: max relative error}), or AssertionError naming the first over `tol`."""
    for name, err in errs.items():
        if not err <= tol:
            raise AssertionError(f"inexact: {name} differs from the reference by {err:.3e} (max relative), "
                                 f"tolerance {tol:.1e}")
    return errs


def grad_targets(args: list) -> list:
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def make_call(fn, args: list, opts: dict, mode: str, grad_out=None, targets=None):
    """A no-argument call: the forward without autograd ("fwd") or with the backward to `targets`."""
    if mode == "fwd":
        def call():     # the timed path: no decorator frame around it
            with torch.no_grad():
                return fn(*args, **opts)[0]
        return call
    targets = grad_targets(args) if targets is None else targets
    return lambda: torch.autograd.grad(fn(*args, **opts)[0], targets, grad_out)


def samu_kinks(args: list):
    """Where the exact pre-relu SAMU state is ~0: a gradient check zeroes the cotangent there, so
    rounding across relu's kink cannot decide it (the audit's rule)."""
    return parity.samu_relu_kinks([a.detach().double() for a in args[:7]], None, args[7])


def gated_backends(gates: dict) -> dict[str, set[str]] | None:
    """{op: backends with a check and no failed check} from gates.json; None when no check names one."""
    passed, failed = {}, {}
    for c in gates.get("checks") or []:
        if c.get("backend") is not None:
            # A backend inexact by design is recorded by the audit but never exact.
            bucket = passed if c.get("passed") and c.get("role") != "inexact-by-design" else failed
            bucket.setdefault(str(c.get("op") or c.get("mixer") or ""), set()).add(str(c["backend"]))
    return {op: names - failed.get(op, set()) for op, names in passed.items()} if passed or failed else None


def exact_backend_names(op: str, names, gates: dict | None, inexact=()) -> list[str]:
    """The backends of `op` matching no `inexact` pattern and passing every audit check."""
    gated = gated_backends(gates) if gates else None
    allowed = None if gated is None else gated.get(op, set().union(*gated.values()) if gated else set())
    return [n for n in names if not any(fnmatch.fnmatch(n, pat) for pat in inexact)
            and (allowed is None or n in allowed)]


def diagnostic_backend_names(op: str, names, gates: dict | None) -> tuple[list[str], set[str]]:
    """(backends a track times, the exact ones): inexact-by-design ones are timed, never selected."""
    names = list(names)
    exact = set(exact_backend_names(op, names, gates))
    return [n for n in names if n in exact or n in ops.inexact_backends()], exact


class Peer:
    """A peer of the bare scan h_t = a_t h_{t-1} + b_t in its own layout, prepared outside the timed
    window; `output()` / `grads()` give y and the gradients of a, b in [B, T, D]. Resets become a
    zero gate (accelerated-scan) or cu_seqlens bounds (fla)."""

    CPU_SKIP = {"accelerated_scan_triton": "its Triton scan takes 2048-wide blocks (minutes a call in the "
                                           "interpreter)", "accelerated_scan_warp": "a CUDA extension",
                "fla_fused_recurrent_hgrn": "its kernels autotune, which needs a GPU driver"}

    def __init__(self, name: str, a, b, segment_pos, grad: bool = False, allow_cpu: bool = False):
        if name not in SCAN_PEERS:
            raise ValueError(f"expected a peer in {list(SCAN_PEERS)}, got {name!r}")
        if b.device.type != "cuda" and name in self.CPU_SKIP and not allow_cpu:
            raise Skip(f"peer {name} not run on the CPU: {self.CPU_SKIP[name]}")
        self.grad, self.reset, self.grad_out = grad, segment_pos == 0, None
        self.log_gates = name == "fla_fused_recurrent_hgrn"
        B, T, D = b.shape
        try:
            if self.log_gates:
                from fla.ops.hgrn import fused_recurrent_hgrn
            elif name.endswith("triton"):
                from accelerated_scan.scalar import scan
            else:
                from accelerated_scan.warp import scan
        except ImportError as e:
            raise Skip(f"peer {name} not available ({e})") from None
        if self.log_gates:
            starts = self.reset.reshape(-1).clone()
            starts[:: T] = True
            cu = torch.cat([starts.nonzero()[:, 0], torch.tensor([B * T], device=b.device)])
            # log-gates kept in FP32; one flattened row split into documents
            inputs = [torch.log(a.detach().float()), b.detach()]
            self.fn = lambda g_, x_: fused_recurrent_hgrn(x_, g_, cu_seqlens=cu)[0]
            self.to_btd, self.from_btd = (lambda t: t.reshape(B, T, D)), (lambda t: t.reshape(1, B * T, D))
        else:
            inputs = [a.detach().masked_fill(self.reset[..., None], 0).to(b.dtype), b.detach()]
            self.fn = scan
            self.to_btd = self.from_btd = lambda t: t.transpose(1, 2)
        self.inputs = [self.from_btd(t).contiguous().requires_grad_(grad) for t in inputs]

    def set_grad_out(self, grad_out):
        self.grad_out = self.from_btd(grad_out).contiguous()

    def call(self):
        if not self.grad:
            with torch.no_grad():
                return self.fn(*self.inputs)
        return torch.autograd.grad(self.fn(*self.inputs), self.inputs, self.grad_out)

    @torch.no_grad()
    def output(self):
        return self.to_btd(self.fn(*self.inputs))

    def grads(self) -> tuple:
        ga, gb = self.call()
        ga = ga.float() / self.inputs[0].detach().exp() if self.log_gates else ga.float()
        return self.to_btd(ga).masked_fill(self.reset[..., None], 0), self.to_btd(gb)


def load_official():
    """The official recurrentgemma package; measure.Skip where it is not installed."""
    try:
        return parity.load_official()
    except ImportError as e:
        raise Skip(f"recurrentgemma not available ({e})") from None


def official_rglru(D: int, blocks: int, dtype, device):
    """(the official RG-LRU layer with weights rounded to `dtype`, our float64 layer with the same weights)."""
    rg = load_official()
    torch.manual_seed(0)
    official = rg.RGLRU(D, blocks, device=device)
    with torch.no_grad():
        for p in official.parameters():
            p.copy_(p.to(dtype))
    return official, kernels.from_recurrentgemma(official, backend="reference").double()
