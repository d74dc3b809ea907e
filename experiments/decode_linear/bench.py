"""Where the 1.3b decode step's time goes: each weight-streaming linear of the generation
engine (`kernels.models.decode.linear`, its built-in tiles) alone, against cuBLAS
(`F.linear`) on the same weights, as device time (CUDA-graph replay) and as a fraction of
the measured copy bandwidth; then the step's 97 linears launched back to back as the
engine launches them (24 layers of distinct weights, then the logits), with and without
programmatic dependent launch, whose excess over the sum of the parts is the cost of the
launch boundaries. Weights rotate over copies of at least 256 MB, so no call finds its
weights in L2. Every variant is gated against float64 first. A decision aid between faster
split-K weight streaming and fewer launch boundaries, not a record.

    python experiments/decode_linear/bench.py --rows 16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import parity
from kernels.models import decode as dk

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow" / "scripts"))
from common import measure  # noqa: E402

# (role, output columns as the engine's launch counts them, K, epilogue) of preset 1.3b; w
# holds both halves for "xy" (timed here as one plain linear over them) and for "up" (gated)
ROLES = (("xy", 5120, 2048, dk.EPI_BIAS), ("out", 2048, 2560, dk.EPI_BIAS), ("up", 6144, 2048, dk.EPI_GATED),
         ("down", 2048, 6144, dk.EPI_BIAS), ("logits", 32000, 2048, dk.EPI_BIAS))
GATE_TOL = 2e-2
ROTATE_BYTES = 256 << 20


def device_ms(fn, calls: int, reps: int = 15) -> float:
    """Median ms per call over `reps` replays of a graph of `calls` calls (the pipeline's device clock)."""
    return measure.device_time(fn, reps, calls, "cuda")["median_ms"]


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (device_ms(lambda: dst.copy_(src), calls=4, reps=10) * 1e-3)


class Role:
    """`copies` independent (a, w, bias) sets of one linear; `ours(i)` / `cublas(i)` run set i."""

    def __init__(self, rows, cols, K, epi, copies, ws, seed=0, device="cuda"):
        g = torch.Generator(device=device).manual_seed(seed)
        n = 2 * cols if epi == dk.EPI_GATED else cols
        self.cols, self.epi, self.ws, self.cfg = cols, epi, ws, dk.default_config(cols, K, rows)
        self.sets = [(torch.randn(rows, K, device=device, generator=g).bfloat16(),
                      (torch.randn(n, K, device=device, generator=g) / K ** 0.5).bfloat16(),
                      torch.randn(n, device=device, generator=g).bfloat16()) for _ in range(copies)]
        self.weight_bytes = n * K * 2

    def ours(self, i, pdl=False):
        a, w, b = self.sets[i % len(self.sets)]
        return dk.linear(a, w, b, epilogue=self.epi, config=self.cfg, workspace=self.ws, pdl=pdl)

    def cublas(self, i):
        a, w, b = self.sets[i % len(self.sets)]
        y = F.linear(a, w, b)
        return F.gelu(y[:, :self.cols], approximate="tanh") * y[:, self.cols:] if self.epi == dk.EPI_GATED else y

    def gate(self) -> dict:
        a, w, b = (t.double() for t in self.sets[0])
        y = a @ w.t() + b
        if self.epi == dk.EPI_GATED:
            y = F.gelu(y[:, :self.cols], approximate="tanh") * y[:, self.cols:]
        return {n: parity.rel_err(f(0), y) for n, f in (("ours", self.ours), ("cublas", self.cublas))}


def rotating(fn, copies):
    """A no-argument call that runs fn(0), fn(1), ... in turn (a graph records the sequence)."""
    i = iter(range(1 << 62))
    return lambda: fn(next(i) % copies)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    bw, ws = copy_bandwidth(), dk.Workspace("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    out, roles = [], {}
    for k, (name, cols, K, epi) in enumerate(ROLES):
        copies = max(2, math.ceil(ROTATE_BYTES / ((2 if epi == dk.EPI_GATED else 1) * cols * K * 2)))
        role = roles[name] = Role(a.rows, cols, K, epi, copies, ws, seed=k)
        gate = role.gate()
        if max(gate.values()) > GATE_TOL:
            out.append({"role": name, "gate": gate, "passed": False})
            print(f"{name}: gate failed {gate}", flush=True)
            continue
        for variant, fn in (("ours", role.ours), ("cublas", role.cublas)):
            ms = device_ms(rotating(fn, copies), calls=4 * copies)
            frac = role.weight_bytes / (ms * 1e-3) / bw
            out.append({"role": name, "variant": variant, "rows": a.rows, "cols": cols, "K": K, "ms": ms,
                        "weight_bytes": role.weight_bytes, "fraction_of_copy": frac, "gate": gate,
                        "config": role.cfg})
            print(f"{name:<7} {variant:<7} {ms * 1e3:8.2f} us  {role.weight_bytes / 1e6:7.1f} MB  {frac:6.1%} of copy",
                  flush=True)
    if all(r.get("passed", True) for r in out):
        layers = {n: Role(a.rows, c, K, e, 24, ws, seed=100 + k) for k, (n, c, K, e) in enumerate(ROLES[:4])}
        alone = sum(r["ms"] for r in out if r["variant"] == "ours" and r["role"] != "logits") * 24 + next(
            r["ms"] for r in out if r["variant"] == "ours" and r["role"] == "logits")
        for pdl in (False, True):
            def step(pdl=pdl):
                for i in range(24):
                    for role in layers.values():
                        role.ours(i, pdl)
                roles["logits"].ours(0, pdl)
            ms = device_ms(step, calls=2, reps=10)
            out.append({"variant": f"step of 97 linears, pdl={pdl}", "ms": ms, "sum_of_parts_ms": alone})
            print(f"97 linears back to back, pdl={pdl}: {ms:.3f} ms (each alone: {alone:.3f} ms in all)", flush=True)
    (a.out / "decode_linear_bench.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "copy_bandwidth": bw, "rows": out}, indent=1, default=str))


if __name__ == "__main__":
    main()
