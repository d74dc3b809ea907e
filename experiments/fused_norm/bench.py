"""The Hawk training step with its norms fused to the residual adds (add_rms_norm.hawk_loss),
and with its blocks under torch.compile, against the model's own step, on one GPU: each
first gated (loss and every gradient, BF16 autocast, against the model in float64 at
a gate shape: within twice the model's own BF16 error), then timed eagerly and as one CUDA graph in both orders, each with the
peak memory and its kernel families from one profiled step. A decision aid, not a record:
a win moves the fusion into `kernels` and the pipeline's train track measures it.

    python experiments/fused_norm/bench.py --preset 1.3b --batch 4 --seq 2048 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2] / "workflow" / "scripts")]
from add_rms_norm import hawk_loss  # noqa: E402
from common import measure  # noqa: E402

from kernels.models import CapturedTrainStep, HawkConfig, HawkLM, compile_blocks, train_step  # noqa: E402

FAMILIES = {"casts": ("direct_copy", "bfloat16_copy"), "fp32 adds": ("CUDAFunctor_add<float>",),
            "norms": ("layer_norm", "GammaBeta", "add_rms_norm"), "matmuls": ("nvjet", "gemm", "cutlass")}
BF16_TOL = 3e-2      # gradients, relative to each parameter's largest, over twice the model's own error
LOSS_TOL = 2 ** -8   # one BF16 rounding


# how each variant changes the model: its own step, the norms fused to the adds, or
# torch.compile of every residual block (inductor fuses the same elementwise work)
VARIANTS = {"model": lambda m: m, "fused": lambda m: setattr(m, "loss", partial(hawk_loss, m)) or m,
            "compiled": compile_blocks}


def build(preset, mixer, variant, vocab, device="cuda"):
    torch.manual_seed(0)
    return VARIANTS[variant](HawkLM(HawkConfig.preset(preset, mixer=mixer, vocab_size=vocab), device=device))


def batch(B, T, vocab, device="cuda"):
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, vocab, (B, T + 1), generator=g).to(device)
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous(), torch.arange(T, device=device).expand(B, T).contiguous()


def gate(preset, mixer, variant, B, T, vocab, device="cuda") -> dict:
    """Loss and gradients of `variant` and of the model's own step (BF16 autocast, FP32
    weights) against the model in float64 on the reference backend, at a gate shape: the
    variant passes where its error is within twice the model's own BF16 error (plus
    `BF16_TOL` of the largest entry), parameter by parameter. Two BF16 steps differ by
    rounding noise alone, which is large for gradients summed over many cancelling terms
    (SAMU's amplitudes), so they are judged against float64, not against each other."""
    tokens, targets, pos = batch(B, T, vocab, device)
    runs = {}
    for name in ("float64", "model", variant):
        m = build(preset, mixer, "model" if name == "float64" else name, vocab, device)
        if name == "float64":
            m = m.double()
            m.set_backend("reference")
            loss = m.loss(tokens, targets, pos)
        else:
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                loss = m.loss(tokens, targets, pos)
        loss.backward()
        runs[name] = (loss.detach().double(), {n: p.grad.double() for n, p in m.named_parameters()})
        del m
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    l64, g64 = runs["float64"]

    def err(g):
        # on the device: parity.rel_err would copy 1.3b gradients to the CPU
        return {n: ((g[n] - g64[n]).abs().max() / g64[n].abs().max().clamp_min(1e-30)).item() for n in g64}

    e_model, e_var = err(runs["model"][1]), err(runs[variant][1])
    excess = {n: e_var[n] - 2 * e_model[n] for n in g64}
    worst = max(excess, key=excess.get)
    l0, l1 = runs["model"][0], runs[variant][0]
    res = {"shape": [B, T], "loss_float64": l64.item(), "loss_model": l0.item(), "loss_variant": l1.item(),
           "loss_rel": abs((l1 - l64) / l64).item(), "loss_rel_model": abs((l0 - l64) / l64).item(),
           "grad_worst": worst, "grad_rel_variant": e_var[worst], "grad_rel_model": e_model[worst],
           "grad_rel_model_max": max(e_model.values()), "tolerance": BF16_TOL}
    res["passed"] = (res["loss_rel"] <= 2 * res["loss_rel_model"] + LOSS_TOL
                     and all(e_var[n] <= 2 * e_model[n] + BF16_TOL for n in g64))
    return res


def families(step) -> dict:
    """Device ms and launches of one step per kernel family (measure.count_kernels of a profiled step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    counted = measure.count_kernels(prof.events())
    out = {k: {"ms": 0.0, "launches": 0} for k in [*FAMILIES, "other"]}
    for name, us in counted["us_by_name"].items():
        fam = out[next((k for k, pats in FAMILIES.items() if any(p in name for p in pats)), "other")]
        fam["ms"] += us / 1e3
        fam["launches"] += counted["by_name"][name]
    return out


def timed(preset, mixer, variant, B, T, vocab, steps, graph) -> dict:
    """The step's eager clock (measure.time_fn) and its peak memory, capture included."""
    model = build(preset, mixer, variant, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True, capturable=True)
    data = batch(B, T, vocab)
    torch.cuda.reset_peak_memory_stats()
    if graph:
        step = partial(CapturedTrainStep(model, opt, *data, autocast=torch.bfloat16), *data)
    else:
        step = partial(train_step, model, opt, *data, autocast=torch.bfloat16)
    setup_peak = torch.cuda.max_memory_allocated()
    t = measure.time_fn(step, reps=steps, warmup=3, device="cuda")
    res = {"median_ms": t["median_ms"], "samples_ms": t["samples_ms"],
           "peak_bytes": max(setup_peak, t["peak_bytes"]), "families": families(step)}
    del model, opt, step
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="1.3b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gate-batch", type=int, default=1, help="the gate's shape, beside a float64 model")
    ap.add_argument("--gate-seq", type=int, default=512)
    ap.add_argument("--mixers", default="rglru,samu")
    ap.add_argument("--variants", default="fused,compiled", help="compared with the model's own step")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mixer in a.mixers.split(","):
        gates = {v: gate(a.preset, mixer, v, a.gate_batch, a.gate_seq, a.vocab) for v in a.variants.split(",")}
        print(f"gates {mixer}: {json.dumps(gates)}", flush=True)
        names = ["model", *(v for v, g in gates.items() if g["passed"])]
        rows += [{"mixer": mixer, "variant": v, "gate": g} for v, g in gates.items() if not g["passed"]]
        for graph in (False, True):
            for order, seq in (("AB", names), ("BA", names[::-1])):
                for v in seq:
                    r = timed(a.preset, mixer, v, a.batch, a.seq, a.vocab, a.steps, graph)
                    rows.append({"mixer": mixer, "variant": v, "graph": graph, "order": order,
                                 "gate": gates.get(v), **r})
                    print(f"{mixer:<6} {'graph' if graph else 'eager'} {order} {v}: "
                          f"{r['median_ms']:.2f} ms, peak {r['peak_bytes'] / 2**30:.2f} GiB, "
                          + ", ".join(f"{k} {v['ms']:.1f}/{v['launches']}" for k, v in r["families"].items()),
                          flush=True)
    (a.out / "fused_norm_bench.json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)},
                                                             "gpu": torch.cuda.get_device_name(), "rows": rows},
                                                            indent=1))


if __name__ == "__main__":
    main()
