"""Benchmark of the generation engine (issue 7) on one GPU, with the official
recurrentgemma sampler step as the peer, in one call:

1. the GPU tests (tests/test_generation_gpu.py) run in a subprocess, log kept; while
   they run (no timing yet): device facts, models built (preset 1.3b, BF16 random
   weights, both mixers), the correctness gate at real shapes and every graph captured
   (which compiles every kernel);
2. correctness gate (before any timing): B = 16 left-padded prompts, 8 greedy steps
   per step-kernel variant; the logits must be within LOWP_FACTOR times the error of
   the same forward done by PyTorch at BF16 (both judged against the FP32 forward of
   the same weights on the same tokens); a variant that fails is not timed;
3. device copy bandwidth -> the weight-streaming floor (parameter bytes / bandwidth);
4. decode step at B = 16 for every variant that passed, both orders (diagnostics);
   the fastest per mixer is chosen from these and used, on fresh runs, below;
5. the official PyTorch sampler step (recurrentgemma 1.0.1, Sampler._sample_step) on
   the same RG-LRU weights, B = 16, and the agreement of its greedy tokens with ours;
6. latency at B = 16: one trajectory of 4096 steps after an empty and a 4096-token
   prompt (prefill excluded), time read at 128, 256, ..., 4096, both orders;
7. throughput: 64-step probes over B in 1..512, then the best B per mixer through
   fresh 512..4096-step trajectories (both orders while the budget lasts).
Sections past the time budget are cut and listed under "cut". Every figure comes from
kernels.timing (CUDA events, raw samples kept); the JSON records GPU, versions,
commit, shapes and samples.

    python workflow/scripts/bench/bench_generate.py --out DIR [--budget-s S] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kernels import parity, timing  # noqa: E402
from kernels.ops import accounting  # noqa: E402
from kernels.models import HawkConfig, HawkLM  # noqa: E402
from kernels.models.generation import Engine  # noqa: E402

FULL = {"preset": "1.3b", "B": 16, "lengths": [128, 256, 512, 1024, 2048, 4096], "prompts": [0, 4096],
        "batches": [1, 4, 16, 32, 64, 96, 128, 192, 256, 384, 512], "probe_steps": 64,
        "thr_lengths": [512, 1024, 2048, 4096], "step_reps": 100, "gate_prompt": 64, "gate_steps": 8,
        "official_reps": 10, "copy_bytes": 2 << 30, "sweep_rows": [16, 1, 64], "sweep_reps": 20}
SMOKE = {"preset": "tiny", "B": 4, "lengths": [4, 8], "prompts": [0, 16], "batches": [1, 4, 8], "probe_steps": 4,
         "thr_lengths": [4, 8], "step_reps": 5, "gate_prompt": 6, "gate_steps": 3, "official_reps": 2,
         "copy_bytes": 1 << 20, "sweep_rows": [16], "sweep_reps": 2}
MIXERS = ("rglru", "samu")
ROLES = ("xy", "out", "up", "down", "logits")


def role_shapes(cfg) -> dict:
    """(output columns, K) of each weight-streaming linear of a Hawk layer."""
    D, E, F, V = cfg.width, cfg.lru_width, cfg.mlp_expanded_width, cfg.vocab_size
    return {"xy": (2 * E, D), "out": (D, E), "up": (F, D), "down": (D, F), "logits": (V, D)}


def variants_for(cfg) -> dict:
    """Step-kernel variants (kernels.models.generation.Engine options). The gemm
    variants use the split-K linear's default (tuned) tiles; "pf" adds the L2 prefetch
    of each program's weights before the PDL wait, "early" lets the next kernel launch
    at the start of the previous one."""
    pf = {r: {"PF": 1} for r in ROLES}
    pf_early = {r: {"PF": 1, "EARLY": 1} for r in ROLES}
    return {
        "model+graph": dict(kernels="model"),
        "fused+graph": dict(kernels="fused"),
        "gemm+graph": dict(kernels="gemm", pdl=False),
        "gemm+graph+pdl": dict(kernels="gemm", pdl=True),
        "gemm+graph+pdl+pf": dict(kernels="gemm", pdl=True, linear_configs=pf),
        "gemm+graph+pdl+pf+early": dict(kernels="gemm", pdl=True, linear_configs=pf_early),
    }


VARIANTS: dict = {}


def run_linear(role, conf, pdl, M, cfg, device, dtype=torch.bfloat16):
    """One launch of a role's linear on random data (fills Triton's compile cache)."""
    from kernels.ops import decode as dk

    D, E, F, V = cfg.width, cfg.lru_width, cfg.mlp_expanded_width, cfg.vocab_size

    def r(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    kw = dict(config=conf, pdl=pdl)
    if role == "xy":
        dk.linear(r(M, D), r(E, D), r(E), prologue=dk.PRO_NORM, norm_scale=r(D), eps=1e-6, epilogue=dk.EPI_XY,
                  w2=r(E, D), bias2=r(E), conv=(r(M, cfg.conv1d_temporal_width - 1, E), r(cfg.conv1d_temporal_width, E),
                                                r(E)),
                  reset=torch.zeros(M, dtype=torch.bool, device=device), **kw)
    elif role == "out":
        dk.linear(r(M, E), r(D, E), r(D), prologue=dk.PRO_MUL, a2=r(M, E), epilogue=dk.EPI_RESIDUAL,
                  residual=r(M, D), **kw)
    elif role == "up":
        dk.linear(r(M, D), r(2 * F, D), r(2 * F), prologue=dk.PRO_NORM, norm_scale=r(D), eps=1e-6,
                  epilogue=dk.EPI_GATED, **kw)
    elif role == "down":
        dk.linear(r(M, F), r(D, F), r(D), epilogue=dk.EPI_RESIDUAL, residual=r(M, D), **kw)
    else:
        dk.linear(r(M, D), r(V, D), None, prologue=dk.PRO_NORM, norm_scale=r(D), eps=1e-6, **kw)


def compile_worker(args):
    """Process-pool worker: compile (by running once) a list of linear launches."""
    preset, tasks, device = args
    sys.path.insert(0, str(REPO))
    cfg = HawkConfig.preset(preset)
    done, failed = 0, []
    for role, conf, pdl, M in tasks:
        try:
            run_linear(role, conf, pdl, M, cfg, torch.device(device))
            done += 1
        except Exception as e:  # noqa: BLE001
            failed.append(f"{role} {conf} pdl={pdl} M={M}: {e!r}")
    if device == "cuda":
        torch.cuda.synchronize()
    return done, failed


def compile_tasks(variants, batches) -> list:
    """Every (role, tile config, pdl, rows) the gemm variants launch, rows 16 first
    (the B of the step and latency sections)."""
    from kernels.ops import decode as dk

    Ms = sorted({min(dk.LINEAR_MAX_ROWS, max(16, 1 << (b - 1).bit_length())) for b in batches
                 if b <= dk.LINEAR_MAX_ROWS}, key=lambda m: (m != 16, m))
    seen, tasks = set(), []
    for M in Ms:
        for v in variants.values():
            if v["kernels"] != "gemm":
                continue
            for role in ROLES:
                conf = (v.get("linear_configs") or {}).get(role)
                key = (role, json.dumps(conf, sort_keys=True), bool(v.get("pdl")), M)
                if key not in seen:
                    seen.add(key)
                    tasks.append((role, conf, bool(v.get("pdl")), M))
    return tasks


def log(*a):
    print(*a, flush=True)


class Budget:
    def __init__(self, seconds):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def env_facts(commit: str) -> dict:
    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "commit": commit, "host": platform.node(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                     memory_bytes=p.total_memory)
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,clocks.max.sm",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            facts["nvidia_smi"] = q.stdout.strip()
        except Exception as e:  # noqa: BLE001
            facts["nvidia_smi"] = f"unavailable: {e}"
    return facts


def build(preset, mixer, device, dtype=torch.bfloat16):
    torch.manual_seed(0)
    cfg = HawkConfig.preset(preset, mixer=mixer)
    return HawkLM(cfg, device=device, dtype=dtype).eval().requires_grad_(False)


def param_bytes(m) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def copy_bandwidth(nbytes, device) -> dict:
    x = torch.randn(nbytes // 4, device=device)
    y = torch.empty_like(x)
    t = timing.time_fn(lambda: y.copy_(x), reps=10, warmup=3, device=device)
    moved = 2 * x.numel() * 4
    return {"bytes_moved": moved, "timing": t, "bytes_per_s": moved / (t["median_ms"] * 1e-3)}


def left_padded_prompts(B, P, V, seed, bos=2):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, P + 1, (B,), generator=g)
    lengths[0] = P
    tokens = torch.randint(3, V, (B, P), generator=g)
    for b in range(B):
        tokens[b, P - lengths[b]] = bos
        tokens[b, : P - lengths[b]] = 0
    return tokens, lengths


def gate(m, m32, yard_model, variant, B, P, steps, device) -> dict:
    """Greedy decode of left-padded prompts with one variant; logits judged against the
    FP32 forward on the same tokens, tolerance from the BF16 PyTorch forward."""
    V = m.config.vocab_size
    tokens, lengths = left_padded_prompts(B, P, V, seed=3)
    eng = Engine(m, **VARIANTS[variant]) if variant != "model-eager" else Engine(m, kernels="model", graphs=False)
    out = list(eng.stream(tokens, steps, lengths=lengths, with_logits=True))
    toks = torch.stack([t for t, _ in out], 1)
    got = torch.stack([lg for _, lg in out], 1)
    seq = torch.cat([tokens.to(device), toks], 1)
    pos = torch.arange(P + steps, device=device)[None, :] - (P - lengths.to(device))[:, None]
    pos = pos.clamp(min=-1)
    with torch.no_grad():
        want = m32(seq, pos)[0][:, P - 1: P - 1 + steps]
        yard = yard_model(seq, pos)[0][:, P - 1: P - 1 + steps]
    err, err_pt = parity.rel_err(got, want), parity.rel_err(yard, want)
    tol = max(parity.LOWP_FACTOR * err_pt, torch.finfo(torch.bfloat16).eps)
    agree = float((toks == want.argmax(-1)).float().mean())
    return {"variant": variant, "error": err, "bf16_pytorch_error": err_pt, "tolerance": tol,
            "passed": bool(err == err and err <= tol), "argmax_agreement_with_fp32": agree,
            "shapes": {"B": B, "P": P, "steps": steps}, "describe": eng.describe(B), "_engine": eng}


class FakeVocab:
    """What recurrentgemma's Sampler asks of a SentencePiece vocabulary (ids only)."""

    def eos_id(self):
        return 1

    def pad_id(self):
        return 0

    def bos_id(self):
        return 2


def official_step(model_rglru, B, reps, device, ours_tokens=None) -> dict:
    from kernels import to_recurrentgemma

    rg = parity.load_official()
    off = to_recurrentgemma(model_rglru).eval().requires_grad_(False)
    sampler = rg.Sampler(off, FakeVocab())
    n = reps + 3 + 12
    # Prompt [BOS, 3] (the official prompt processing needs return_logits for a
    # one-token prompt).
    tokens = torch.tensor([[2, 3]] * B, dtype=torch.int32, device=device)
    with torch.no_grad():
        state = sampler._prompt_processing_fn(tokens, torch.full((B,), 2, dtype=torch.int32, device=device), n,
                                              False, False)
        box = [state]

        def one():
            box[0] = sampler._sample_step(box[0], True)

        for _ in range(11):     # 12 tokens: the prompt step's and 11 sampled ones
            one()
        first = box[0].tokens_buffer[:, :12].to(torch.int64).clone()
        t = timing.time_fn(one, reps=reps, warmup=2, device=device)
    rec = {"timing": t, "B": B, "what": "recurrentgemma.torch Sampler._sample_step (eager, bf16, greedy)",
           "first_tokens_row0": first[0].tolist()}
    if ours_tokens is not None:
        rec["greedy_token_agreement_first12"] = float((first.cpu() == ours_tokens[:, :12].cpu()).float().mean())
        rec["ours_first_tokens_row0"] = ours_tokens[0, :12].tolist()
    return rec


def kernel_category(name: str) -> str:
    n = name.lower()
    if "linear_kernel" in n:
        return "weight-streaming linear (ours)"
    if any(k in n for k in ("gemm", "gemv", "cutlass", "xmma", "cublas", "nvjet", "splitk")):
        return "library matmul (cuBLAS)"
    if "rglru_step" in n or "samu_step" in n or "step_kernel" in n and "conv" not in n:
        return "mixer step"
    if any(k in n for k in ("embed_rmsnorm", "add_rmsnorm", "conv_step", "gelu_mul", "advance")):
        return "row kernels (ours)"
    if "argmax" in n or "reduce" in n:
        return "next-token choice"
    return "other PyTorch kernels"


LINEAR_ROLES_ORDER = ("xy", "out", "up", "down")


def profile_step(model, opts, B, device, steps=3) -> dict:
    """Kernel durations of `steps` eager decode steps (torch.profiler, CUDA activity):
    totals per kernel and per category, and for our linears per role (launch order
    xy, out, up, down per layer, then logits) with the weight bytes each streams."""
    from torch.profiler import ProfilerActivity, profile

    eng = Engine(model, graphs=False, **opts)
    eng.start(batch_size=B)
    for _ in range(2):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kern.sort(key=lambda e: e.time_range.start)
    by_name, by_cat = {}, {}
    for e in kern:
        d = by_name.setdefault(e.name, {"us": 0.0, "count": 0})
        d["us"] += e.device_time / steps
        d["count"] += 1 / steps
        by_cat[kernel_category(e.name)] = by_cat.get(kernel_category(e.name), 0.0) + e.device_time / steps
    cfg = model.config
    D, E, F, V = cfg.width, cfg.lru_width, cfg.mlp_expanded_width, cfg.vocab_size
    wbytes = {"xy": 2 * D * E * 2, "out": E * D * 2, "up": 2 * F * D * 2, "down": F * D * 2, "logits": V * D * 2}
    lin = [e.device_time for e in kern if "linear_kernel" in e.name]
    roles = {}
    per_step = 4 * cfg.num_layers + 1
    if lin and len(lin) == steps * per_step:
        for i, us in enumerate(lin):
            j = i % per_step
            role = "logits" if j == per_step - 1 else LINEAR_ROLES_ORDER[j % 4]
            r = roles.setdefault(role, {"us": 0.0, "n": 0})
            r["us"] += us
            r["n"] += 1
        for role, r in roles.items():
            r["mean_us"] = r["us"] / r["n"]
            r["weight_bytes"] = wbytes[role]
            r["bytes_per_s"] = wbytes[role] / (r["mean_us"] * 1e-6)
    top = sorted(by_name.items(), key=lambda kv: -kv[1]["us"])[:25]
    return {"B": B, "opts": opts, "steps": steps, "kernel_us_per_step": sum(by_cat.values()),
            "launches_per_step": len(kern) / steps, "by_category_us": by_cat, "top_kernels": dict(top),
            "linear_roles": roles}


def profile_main(a, S, out_dir, device):
    """Where the decode step's time goes: kernel durations of eager steps by category
    and per linear role (torch.profiler), against the graph-replayed step. PDL variants
    are left out: a kernel launched early would count its wait for the previous one."""
    res = {"schema": "generation-profile/1", "env": env_facts(a.commit), "profiles": [], "step": [],
           "throughput": [], "errors": []}
    path = out_dir / f"generation_h200{a.tag}_profile.json"

    def save():
        path.write_text(json.dumps(json.loads(json.dumps(res, default=lambda o: None)), indent=1))

    all_variants = variants_for(HawkConfig.preset(S["preset"]))
    variants = {k: all_variants[k] for k in ("fused+graph", "gemm+graph")}
    res["variants"] = variants
    import multiprocessing as mp

    tasks = compile_tasks(variants, [S["B"]])
    pool = mp.get_context("spawn").Pool(min(12, len(tasks)))
    pool_res = pool.map_async(compile_worker, [(S["preset"], tasks[i::12], "cuda") for i in range(12)])
    models = {"rglru": build(S["preset"], "rglru", device)}
    res["compile"] = [list(x) for x in pool_res.get(timeout=120)]
    pool.terminate()
    for v, opts in variants.items():
        try:
            eng = Engine(models["rglru"], **opts)
            eng.start(batch_size=S["B"])
            t = timing.time_fn(eng.step, reps=100, warmup=5, device=device)
            res["step"].append({"mixer": "rglru", "variant": v, "B": S["B"], "timing": t})
            pr = profile_step(models["rglru"], opts, S["B"], device)
            pr["variant"], pr["graph_step_median_us"] = v, t["median_ms"] * 1e3
            res["profiles"].append(pr)
            log(f"{v}: graph step {t['median_ms']:.3f} ms; kernels {pr['kernel_us_per_step']:.0f} us in "
                f"{pr['launches_per_step']:.0f} launches: " + ", ".join(f"{k} {u:.0f}" for k, u in
                                                                          pr["by_category_us"].items()))
            for role, r in pr["linear_roles"].items():
                log(f"    {role}: {r['mean_us']:.1f} us, {r['bytes_per_s'] / 1e12:.2f} TB/s")
        except Exception as e:  # noqa: BLE001
            res["errors"].append({"variant": v, "error": traceback.format_exc()})
            log(f"{v}: ERROR {e!r}")
        save()
    save()
    log(f"wrote {path}")


# ----------------------------------------------------------------------------- linear sweep (--sweep)


class RoleBench:
    """One weight-streaming linear of a Hawk layer (role xy, out, up, down or logits) at
    M rows: inputs, `copies` weight sets (their total exceeds the L2 cache, so a graph of
    launches cycling through them streams from memory), our launch, the same matmul
    through cuBLAS (F.linear, no fused row work), and the role's computation in PyTorch
    at any dtype (float64: the reference; BF16: the yardstick)."""

    def __init__(self, role, cfg, M, device, copies, dtype=torch.bfloat16):
        import math

        from kernels import layers

        self.role, self.M, self.device, self.dtype = role, M, device, dtype
        D, E, F, V = cfg.width, cfg.lru_width, cfg.mlp_expanded_width, cfg.vocab_size
        self.Fw = F
        g = torch.Generator(device=device).manual_seed(ROLES.index(role))

        def r(*shape, std=1.0):
            return (torch.randn(*shape, device=device, generator=g) * std).to(dtype)

        K = {"xy": D, "out": E, "up": D, "down": F, "logits": D}[role]
        rows = {"xy": E, "out": D, "up": 2 * F, "down": D, "logits": V}[role]
        self.K, self.N = K, rows
        std = 1 / math.sqrt(K)
        self.sets = []
        for _ in range(copies):
            s = {"w": r(rows, K, std=std), "bias": r(rows, std=0.1) if role != "logits" else None}
            if role == "xy":
                s["w2"], s["bias2"] = r(rows, K, std=std), r(rows, std=0.1)
                s["cat"] = torch.cat([s["w"], s["w2"]])
                s["catb"] = torch.cat([s["bias"], s["bias2"]])
            self.sets.append(s)
        self.weight_bytes = sum(t.numel() * t.element_size() for k, t in self.sets[0].items()
                                if t is not None and k in ("w", "w2"))
        self.x = r(M, K)
        self.scale = r(K, std=0.1)
        self.eps = 1e-6
        self.a2 = r(M, K)
        self.res = r(M, rows)
        self.conv_w, self.conv_b = r(4, rows, std=0.05), r(rows, std=0.1)
        self.state = r(M, 3, rows)
        # what timed launches update in place (the checks use clones of res and state)
        self.res_t, self.state_t = self.res.clone(), self.state.clone()
        self.reset = torch.arange(M, device=device) % 5 == 1
        self.layers = layers

    def ours(self, i, conf, pdl=False, workspace=None, res=None, state=None):
        from kernels.ops import decode as dk

        s = self.sets[i % len(self.sets)]
        kw = dict(config=conf, pdl=pdl, workspace=workspace)
        if self.role == "xy":
            return dk.linear(self.x, s["w"], s["bias"], prologue=dk.PRO_NORM, norm_scale=self.scale, eps=self.eps,
                             epilogue=dk.EPI_XY, w2=s["w2"], bias2=s["bias2"],
                             conv=(self.state_t if state is None else state, self.conv_w, self.conv_b),
                             reset=self.reset, **kw)
        if self.role == "out":
            return dk.linear(self.x, s["w"], s["bias"], prologue=dk.PRO_MUL, a2=self.a2, epilogue=dk.EPI_RESIDUAL,
                             residual=self.res_t if res is None else res, **kw)
        if self.role == "up":
            return dk.linear(self.x, s["w"], s["bias"], prologue=dk.PRO_NORM, norm_scale=self.scale, eps=self.eps,
                             epilogue=dk.EPI_GATED, **kw)
        if self.role == "down":
            return dk.linear(self.x, s["w"], s["bias"], epilogue=dk.EPI_RESIDUAL,
                             residual=self.res_t if res is None else res, **kw)
        return dk.linear(self.x, s["w"], None, prologue=dk.PRO_NORM, norm_scale=self.scale, eps=self.eps, **kw)

    def cublas(self, i):
        s = self.sets[i % len(self.sets)]
        if self.role == "xy":
            return torch.nn.functional.linear(self.x, s["cat"], s["catb"])
        return torch.nn.functional.linear(self.x, s["w"], s["bias"])

    def eager(self, dt):
        """The role's outputs for weight set 0 computed by PyTorch in dtype dt."""
        L, s = self.layers, {k: (v.to(dt) if v is not None else None) for k, v in self.sets[0].items()}
        x, F_ = self.x.to(dt), torch.nn.functional

        def norm(v):
            n = L.RMSNorm(v.shape[1], eps=self.eps, device=self.device, dtype=dt)
            n.scale.data.copy_(self.scale)
            return n(v)

        if self.role == "xy":
            n = norm(x)
            conv = L.Conv1D(self.N, device=self.device, dtype=dt)
            conv.w.data.copy_(self.conv_w)
            conv.b.data.copy_(self.conv_b)
            st = self.state.to(dt).clone()
            y = conv.step(F_.linear(n, s["w2"], s["bias2"]), st, self.reset)
            return [L.gelu(F_.linear(n, s["w"], s["bias"])), y, st]
        if self.role == "out":
            return [F_.linear(x * self.a2.to(dt), s["w"], s["bias"]) + self.res.to(dt)]
        if self.role == "up":
            u = F_.linear(norm(x), s["w"], s["bias"])
            return [L.gelu(u[:, :self.Fw]) * u[:, self.Fw:]]
        if self.role == "down":
            return [F_.linear(x, s["w"], s["bias"]) + self.res.to(dt)]
        return [F_.linear(norm(x), s["w"])]

    def check(self, conf, pdl=False):
        """Our outputs against float64 (at most LOWP_FACTOR times PyTorch's BF16 error),
        and a second run equal bit for bit (the split-K reduction is deterministic)."""
        from kernels.ops import decode as dk

        outs = []
        for _ in range(2):
            res, st = self.res.clone(), self.state.clone()
            o = self.ours(0, conf, pdl, dk.Workspace(self.device), res=res, state=st)
            o = list(o) + [st] if self.role == "xy" else [res] if self.role in ("out", "down") else [o]
            outs.append([t.clone() for t in o])
        if not hasattr(self, "_refs"):
            self._refs = self.eager(torch.float64), self.eager(self.dtype)
        want, yard = self._refs
        errs = [parity.rel_err(g, w) for g, w in zip(outs[0], want)]
        errs_pt = [parity.rel_err(y, w) for y, w in zip(yard, want)]
        tols = [max(parity.LOWP_FACTOR * e, torch.finfo(self.dtype).eps) for e in errs_pt]
        ok = all(e == e and e <= t for e, t in zip(errs, tols))
        same = all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
        return {"errors": errs, "bf16_pytorch_errors": errs_pt, "tolerances": tols, "passed": bool(ok and same),
                "deterministic": same}


def graph_time(launch, n, reps, device) -> dict:
    """Median time per launch of a CUDA graph of n launches launch(0..n-1) (eager on
    the CPU), with the raw samples of the whole graph."""
    if device.type != "cuda":
        t = timing.time_fn(lambda: [launch(i) for i in range(n)], reps=reps, warmup=1, device=device)
        return {"graph": t, "n": n, "us_per_launch": t["median_ms"] * 1e3 / n}
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(n):
            launch(i)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            launch(i)
    t = timing.time_fn(graph.replay, reps=reps, warmup=2, device=device)
    del graph
    return {"graph": t, "n": n, "us_per_launch": t["median_ms"] * 1e3 / n}


def legacy_config(cols, K) -> dict:
    """The tiles of the first run's "deep" variant (one program per column block, no
    K split), for comparison."""
    import triton

    bn = 16
    while bn < 128 and triton.cdiv(cols, bn * 2) >= 128:
        bn *= 2
    bk = min(256 if bn <= 16 else 128, max(16, triton.next_power_of_2(K)))
    c = {"BN": bn, "BK": bk, "SPLIT": 1, "SWAP": 0, "PRE": 0, "num_warps": 4, "num_stages": 4 if bn <= 32 else 3}
    if bn <= 32:
        c.update(BK=min(2 * bk, 512), num_stages=4)
    return c


def sweep_grid(cols, K, gated, smoke=False) -> list:
    """Tile configurations to try for one role: column block BN, K per program KS (the
    split), K slice BK per iteration, swapped dot; register-resident first slice kept
    at <= 32 KiB of weights per program for 4 warps."""
    import triton

    from kernels.ops import decode as dk

    if smoke:
        return [dict(BN=64, BK=32, SPLIT=2, SWAP=1, PRE=1, num_warps=4, num_stages=2)]
    out, seen = [], set()
    for BN in (32, 64, 128):
        blocks = triton.cdiv(cols, BN)
        for KS in (128, 256, 512, 1024, 2048):
            split = triton.cdiv(K, KS)
            for BK in ((64, 128, 256) if BN == 128 else (128, 256)):
                if BK > KS or BN * BK * (2 if gated else 1) > 16384:
                    continue
                ks, sp = dk.split_plan(K, BK, split)
                if not 128 <= blocks * sp <= 8192:
                    continue
                for swap in ((0, 1) if BN >= 64 else (0,)):
                    for pre in ((1, 0) if ks > BK else (1,)):
                        key = (BN, BK, ks, swap, pre)
                        if key in seen:
                            continue
                        seen.add(key)
                        out.append(dict(BN=BN, BK=BK, SPLIT=sp, SWAP=swap, PRE=pre, num_warps=4, num_stages=3))
    return out


def _sweep_compile(args):
    """Process-pool worker: run (and so compile) a list of (role, M, conf, pdl)."""
    preset, tasks, device = args
    sys.path.insert(0, str(REPO))
    cfg = HawkConfig.preset(preset)
    benches, failed = {}, []
    for role, M, conf, pdl in tasks:
        try:
            if (role, M) not in benches:
                benches[(role, M)] = RoleBench(role, cfg, M, torch.device(device), 1)
            benches[(role, M)].ours(0, conf, pdl)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{role} M={M} {conf} pdl={pdl}: {e!r}")
    if device == "cuda":
        torch.cuda.synchronize()
    return failed


def sweep_main(a, S, out_dir, device):
    """Microbenchmark of the split-K linear at the five linear shapes of preset
    1.3b: a grid of tiles at M = 16, then the neighbours of the best (warps, stages,
    PDL), the best few at M = 1 and 64, cuBLAS (F.linear, same weight bytes) and the
    copy bandwidth as references; then the B = 16 step of the engine with the chosen
    tiles. Each config is checked against float64 before it is timed."""
    import multiprocessing as mp

    from kernels.ops import decode as dk

    cuda = device.type == "cuda"
    res = {"schema": "generation-linear-sweep/1", "env": env_facts(a.commit), "preset": S["preset"], "roles": {},
           "cublas": {}, "best": {}, "rows": {}, "step": [], "errors": []}
    path = out_dir / ("linear_sweep_smoke.json" if a.smoke else "linear_sweep_h200.json")

    def save():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(json.loads(json.dumps(res, default=lambda o: None)), indent=1))
        tmp.replace(path)

    budget = Budget(a.budget_s)
    cfg = HawkConfig.preset(S["preset"])
    shapes = role_shapes(cfg)
    grids = {role: sweep_grid(cols, K, role == "up", a.smoke) for role, (cols, K) in shapes.items()}
    legacy = {role: legacy_config(cols, K) for role, (cols, K) in shapes.items()}
    for role in grids:
        grids[role].append(legacy[role])
    tasks = [(role, 16, c, False) for role, cs in grids.items() for c in cs]
    log(f"sweep: {len(tasks)} configs at M=16")

    def compile_all(tasks):
        t0 = time.perf_counter()
        if not cuda:
            return _sweep_compile((S["preset"], tasks[:2], "cpu"))
        n = max(1, min(14, (os.cpu_count() or 4) - 2, len(tasks)))
        with mp.get_context("spawn").Pool(n) as pool:
            got = pool.map(_sweep_compile, [(S["preset"], tasks[i::n], "cuda") for i in range(n)])
        failed = [f for fs in got for f in fs]
        log(f"compiled {len(tasks)} in {time.perf_counter() - t0:.1f} s, {len(failed)} failed")
        return failed

    res["compile_failed"] = compile_all(tasks)
    res["copy_bandwidth"] = copy_bandwidth(S["copy_bytes"], device)
    bw = res["copy_bandwidth"]["bytes_per_s"]
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    l2 = 256 << 20
    benches = {}

    def bench(role, M):
        if (role, M) not in benches:
            wb = 2 * shapes[role][0] * shapes[role][1] * (2 if role == "up" else 1)
            copies = 1 if a.smoke else max(2, -(-l2 // wb))
            benches[(role, M)] = RoleBench(role, cfg, M, device, copies)
        return benches[(role, M)]

    def measure(role, M, conf, pdl=False, tag=""):
        b = bench(role, M)
        rec = {"role": role, "M": M, "config": conf, "pdl": pdl, "tag": tag}
        try:
            rec["check"] = b.check(conf, pdl)
            if rec["check"]["passed"]:
                ws = dk.Workspace(device)
                n = 2 if a.smoke else max(24, len(b.sets))
                t = graph_time(lambda i: b.ours(i, conf, pdl, ws), n, S["sweep_reps"], device)
                rec.update(t)
                rec["bytes_per_s"] = b.weight_bytes / (t["us_per_launch"] * 1e-6)
        except Exception as e:  # noqa: BLE001
            rec["error"] = traceback.format_exc()
            log(f"  {role} M={M} {conf}: ERROR {e!r}")
        res["roles"].setdefault(role, []).append(rec)
        return rec

    def fmt(r):
        c = r["config"]
        s = (f"BN{c['BN']} BK{c['BK']} S{c['SPLIT']} W{c['SWAP']} P{c.get('PRE')} w{c['num_warps']} "
             f"s{c['num_stages']}")
        s += " pdl" if r["pdl"] else ""
        if "us_per_launch" not in r:
            return s + (" FAILED CHECK" if "check" in r else " ERROR")
        return s + f": {r['us_per_launch']:.2f} us {r['bytes_per_s'] / 1e12:.2f} TB/s"

    # cuBLAS reference per role at M = 16, 1, 64
    for role in shapes:
        for M in S["sweep_rows"]:
            b = bench(role, M)
            try:
                t = graph_time(lambda i: b.cublas(i), 2 if a.smoke else max(24, len(b.sets)), S["sweep_reps"], device)
                res["cublas"][f"{role}/M{M}"] = dict(t, bytes_per_s=b.weight_bytes / (t["us_per_launch"] * 1e-6))
                log(f"cuBLAS {role} M={M}: {t['us_per_launch']:.2f} us "
                    f"{b.weight_bytes / (t['us_per_launch'] * 1e-6) / 1e12:.2f} TB/s")
            except Exception:  # noqa: BLE001
                res["errors"].append({"section": "cublas", "role": role, "M": M, "error": traceback.format_exc()})
    save()

    def ranked(role, pdl=None):
        return sorted([r for r in res["roles"].get(role, []) if "us_per_launch" in r
                       and (pdl is None or r["pdl"] == pdl)], key=lambda r: r["us_per_launch"])

    def pick_best():
        for role in grids:
            ok, okp = ranked(role, False), ranked(role, True)
            if ok:
                res["best"][role] = {"config": ok[0]["config"], "us": ok[0]["us_per_launch"],
                                     "bytes_per_s": ok[0]["bytes_per_s"],
                                     "pdl_best": okp[0]["config"] if okp else None,
                                     "pdl_us": okp[0]["us_per_launch"] if okp else None}
                log(f"best {role}: {fmt(ok[0])}" + (f" | with PDL {fmt(okp[0])}" if okp else ""))
        save()

    models = {}

    def step_section(tag):
        """The engine's B = 16 step (rglru) with the best tiles so far."""
        try:
            model = models.get("rglru") or models.setdefault("rglru", build(S["preset"], "rglru", device))
        except Exception as e:  # noqa: BLE001
            res["errors"].append({"section": "step", "error": traceback.format_exc()})
            log(f"step: ERROR {e!r}")
            return
        best = {role: b["config"] for role, b in res["best"].items()}
        bestp = {role: (b["pdl_best"] or b["config"]) for role, b in res["best"].items()}
        variants = [("gemm+graph+split", dict(kernels="gemm", pdl=False, linear_configs=best)),
                    ("gemm+graph+split+pdl", dict(kernels="gemm", pdl=True, linear_configs=bestp))]
        if tag == "grid":
            variants = [("fused+graph", dict(kernels="fused"))] + variants + [("gemm+graph+default",
                                                                                 dict(kernels="gemm", pdl=False))]
        for name, opts in variants:
            if budget.left() < 12:
                res["errors"].append({"section": "step", "variant": name, "after": tag, "error": "budget"})
                continue
            try:
                eng = Engine(model, graphs=cuda, **opts)
                eng.start(batch_size=S["B"])
                t = timing.time_fn(eng.step, reps=S["step_reps"], warmup=3, device=device)
                res["step"].append({"variant": name, "after": tag, "opts": opts, "B": S["B"], "timing": t})
                log(f"step rglru {name} (tiles after {tag}) B={S['B']}: median {t['median_ms']:.3f} ms "
                    f"(p10 {t['p10_ms']:.3f}, p95 {t['p95_ms']:.3f})")
                del eng
            except Exception as e:  # noqa: BLE001
                res["errors"].append({"section": "step", "variant": name, "after": tag, "error": traceback.format_exc()})
                log(f"step {name}: ERROR {e!r}")
            save()

    # phase 1: the grid at M = 16
    for role, cs in grids.items():
        for c in cs:
            if budget.left() < 0.45 * a.budget_s and c is not legacy[role]:
                res["errors"].append({"section": "grid", "role": role, "config": c, "error": "budget"})
                continue
            measure(role, 16, c, tag="legacy" if c is legacy[role] else "grid")
        ok = ranked(role)
        leg = next((r for r in res["roles"].get(role, []) if r["tag"] == "legacy"), None)
        log(f"{role}: best of {len(cs)}: " + "; ".join(fmt(r) for r in ok[:3])
            + (" | no split (old tiles): " + fmt(leg) if leg else ""))
        save()
    pick_best()
    if budget.left() > 40:
        step_section("grid")
    # phase 2: neighbours of the 3 best (warps, stages, PDL)
    nb_tasks = []
    for role in grids:
        for r in ranked(role)[:1 if a.smoke else 3]:
            c = r["config"]
            for v in (() if a.smoke else (dict(c, num_warps=8), dict(c, num_stages=2), dict(c, num_stages=5))):
                nb_tasks.append((role, 16, v, False))
            nb_tasks.append((role, 16, c, True))
    if budget.left() > 60:
        compile_all(nb_tasks)
        for role, M, c, pdl in nb_tasks:
            if budget.left() > 20:
                measure(role, M, c, pdl, tag="neighbour")
        save()
    pick_best()
    # rows 1 and 64: the best two at 16 and the default
    row_tasks = []
    for role in grids:
        for M in S["sweep_rows"]:
            if M != 16:
                for c in [r["config"] for r in ranked(role, False)[:2]] + [dk.default_config(*shapes[role], M)]:
                    row_tasks.append((role, M, c, False))
    if budget.left() > 45:
        compile_all([t for t in row_tasks if t[1] != 1])
        for role, M, c, pdl in row_tasks:
            if budget.left() > 25:
                measure(role, M, c, pdl, tag="rows")
        save()
    if budget.left() > 25:
        step_section("neighbours")
    res["budget_left_s"] = budget.left()
    save()
    log(f"wrote {path}")


def report(folder: Path, tag: str = "", level: str = "#") -> str:
    """Markdown summary of the result files of one run in `folder` (file names with
    suffix `tag`; generated, never edited)."""
    r = json.loads((folder / f"generation_h200{tag}.json").read_text())
    pf = folder / f"generation_h200{tag}_profile.json"
    prof = json.loads(pf.read_text()) if pf.exists() else None
    e, sh = r["env"], r["shapes"]
    h = level + "#"
    L = [f"{level} Generation on the {e.get('gpu')}{' (' + tag.strip('_') + ')' if tag else ''} "
         "(generated by bench_generate.py --report)", "",
         f"commit {e['commit'][:10]}, torch {e['torch']}, triton {e['triton']}, CUDA {e['cuda']}, "
         f"driver/clocks `{e.get('nvidia_smi')}`, {e['time_utc']}.",
         f"Preset {sh['preset']} (D={sh['width']}, {sh['layers']} layers, D_RNN={sh['lru_width']}, "
         f"MLP {sh['mlp']}, V={sh['vocab']}), BF16 random weights, FP32 recurrent state.",
         f"Copy bandwidth {r['copy_bandwidth']['bytes_per_s'] / 1e12:.2f} TB/s (read + written); weight-streaming "
         f"floor (parameter bytes / bandwidth): " + ", ".join(f"{m} {v:.3f} ms" for m, v in r["floor_ms"].items()),
         "", f"GPU tests: {r.get('tests', {}).get('summary', ['?'])[-1]} (gpu_tests{tag}.log)", "",
         f"{h} Correctness gate (B = 16, left-padded prompts up to 64 tokens, 8 greedy steps)", "",
         "| mixer | variant | error vs FP32 | BF16 PyTorch error | tolerance | pass |", "|---|---|---|---|---|---|"]
    for mx, rows in r["gate"].items():
        for g in rows:
            if "error" in g:
                L.append(f"| {mx} | {g['variant']} | {g['error']:.4f} | {g['bf16_pytorch_error']:.4f} | "
                         f"{g['tolerance']:.4f} | {g['passed']} |")
    L += ["", f"{h} Decode step, B = {r['settings']['B']}, empty prompt (median ms of {r['settings']['step_reps']} "
          "graph replays; AB / BA order)", "", "| mixer | variant | AB | BA | floor |", "|---|---|---|---|---|"]
    step = {}
    for x in r["step"]:
        step.setdefault((x["mixer"], x["variant"]), {})[x["order"]] = x["timing"]["median_ms"]
    for (mx, v), o in step.items():
        L.append(f"| {mx} | {v} | {o.get('AB', float('nan')):.3f} | {o.get('BA', float('nan')):.3f} | "
                 f"{r['floor_ms'][mx]:.3f} |")
    if "official" in r:
        o = r["official"]
        L += ["", f"Official recurrentgemma 1.0.1 `Sampler._sample_step` (eager, same RG-LRU weights, B = {o['B']}): "
              f"median {o['timing']['median_ms']:.2f} ms per step; its greedy tokens agree with ours on "
              f"{o.get('greedy_token_agreement_first12', 0):.0%} of the first 12 (BF16 near-ties of random weights)."]
    L += ["", "Selected per mixer: " + ", ".join(f"{m} {s['variant']}" for m, s in r["selected"].items()), "",
          f"{h} Latency, B = 16 (cumulative ms to N generated tokens, prefill excluded)", "",
          "| mixer | prompt | order | " + " | ".join(str(n) for n in r["settings"]["lengths"]) + " | ms/step |",
          "|---|---|---|" + "---|" * (len(r["settings"]["lengths"]) + 1)]
    for x in r["latency"]:
        c = x["trajectory"]["cumulative_ms"]
        L.append(f"| {x['mixer']} | {x['prompt']} | {x['order']} | " + " | ".join(f"{v:.0f}" for v in c)
                 + f" | {x['ms_per_step'][-1]:.3f} |")
    L += ["", f"{h} Throughput probes ({r['settings']['probe_steps']} steps, empty prompt; tokens/s)", "",
          "| B | " + " | ".join(r["selected"]) + " |", "|---|" + "---|" * len(r["selected"])]
    probes = {}
    for x in r["throughput_probe"]:
        probes.setdefault(x["B"], {})[x["mixer"]] = x.get("tokens_per_s")
    for B, v in probes.items():
        L.append(f"| {B} | " + " | ".join(f"{v[m]:.0f}" if v.get(m) else "-" for m in r["selected"]) + " |")
    thr = r["throughput"] + (prof["throughput"] if prof else [])
    L += ["", f"{h} Throughput at the best batch (fresh trajectories; tokens/s at N steps)", ""]
    for x in thr:
        L.append(f"- {x['mixer']} B={x['B']} ({x['order']}, {x['kernels']}): " + ", ".join(
            f"{n}: {t:.0f}" for n, t in zip(x["trajectory"]["checkpoints"], x["tokens_per_s"])))
    if prof:
        L += ["", f"{h} Where the B = 16 step goes (rglru; torch.profiler kernel times of eager steps, us per step)", "",
              "| variant | graph step | kernel sum | launches | by category | linears per role (us, TB/s) |",
              "|---|---|---|---|---|---|"]
        for p in prof["profiles"]:
            cats = ", ".join(f"{k} {v:.0f}" for k, v in sorted(p["by_category_us"].items(), key=lambda kv: -kv[1]))
            roles = ", ".join(f"{k} {v['mean_us']:.1f} us {v['bytes_per_s'] / 1e12:.2f}"
                              for k, v in p["linear_roles"].items())
            L.append(f"| {p['variant']} | {p['graph_step_median_us']:.0f} | {p['kernel_us_per_step']:.0f} | "
                     f"{p['launches_per_step']:.0f} | {cats} | {roles or '-'} |")
    cut = r["cut"] + ([prof["cut"]] if prof and prof.get("cut") else [])
    L += ["", f"{h} Cut for the time budget", ""] + [f"- {json.dumps(c)}" for c in cut] + [""]
    return "\n".join(L)


def _fmt_tiles(c) -> str:
    return (f"BN {c['BN']}, BK {c['BK']}, SPLIT {c['SPLIT']}, SWAP {c['SWAP']}, PRE {c.get('PRE', 0)}, "
            f"{c['num_warps']} warps, {c['num_stages']} stages")


def sweep_report(folder: Path, h: str = "## ") -> list:
    """Lines of the linear sweep's summary (linear_sweep_h200.json)."""
    r = json.loads((folder / "linear_sweep_h200.json").read_text())
    e, bw = r["env"], r["copy_bandwidth"]["bytes_per_s"]
    recs = [x for xs in r["roles"].values() for x in xs]
    timed = [x for x in recs if "us_per_launch" in x]
    L = [f"{h}Split-K linear sweep (bench_generate.py --sweep; linear_sweep_h200.json, linear_sweep.log)", "",
         f"commit {e['commit'][:10]}, {e.get('gpu')}, torch {e['torch']}, triton {e['triton']}, CUDA {e['cuda']}, "
         f"driver/clocks `{e.get('nvidia_smi')}`, {e['time_utc']}. Copy bandwidth {bw / 1e12:.2f} TB/s.",
         f"{len(recs)} (role, rows, tiles, PDL) configurations, {sum(1 for x in recs if x.get('check', {}).get('passed'))}"
         " passed the check (float64 reference, at most 2x the BF16 PyTorch error, two runs bit-identical) and were "
         "timed: median of 20 replays of a CUDA graph of >= 24 dependent launches cycling over weight copies "
         "larger than L2 (256 MiB per role), so every launch streams from memory; us per launch include the "
         "launch-to-launch dependency as in the step. cuBLAS: F.linear on the same weight bytes (no fused row work).",
         "", "| role (N x K) | weight MB | best tiles (M = 16) | us | TB/s | with PDL: us | cuBLAS us (TB/s) | "
         "no split, first-run tiles: us (TB/s) | us above bytes / copy bandwidth: ours, cuBLAS |",
         "|---|---|---|---|---|---|---|---|---|"]
    shapes = {"xy": "2x2560 x 2048", "out": "2048 x 2560", "up": "2x6144 x 2048", "down": "2048 x 6144",
              "logits": "32000 x 2048"}
    for role, b in r["best"].items():
        wb = next(x for x in timed if x["role"] == role)
        wbytes = wb["bytes_per_s"] * wb["us_per_launch"] * 1e-6
        cb = r["cublas"].get(f"{role}/M16", {})
        leg = next((x for x in timed if x["role"] == role and x["tag"] == "legacy"), None)
        L.append(f"| {role} ({shapes.get(role, '')}) | {wbytes / 1e6:.1f} | {_fmt_tiles(b['config'])} | {b['us']:.2f} | "
                 f"{b['bytes_per_s'] / 1e12:.2f} | {b['pdl_us']:.2f} | "
                 f"{cb.get('us_per_launch', float('nan')):.2f} ({cb.get('bytes_per_s', float('nan')) / 1e12:.2f}) | "
                 + (f"{leg['us_per_launch']:.2f} ({leg['bytes_per_s'] / 1e12:.2f})" if leg else "-")
                 + f" | {b['us'] - wbytes / bw * 1e6:.1f}, {cb.get('us_per_launch', float('nan')) - wbytes / bw * 1e6:.1f} |")
    L += ["", "Other row counts (tiles of the two best at M = 16 and the heuristic default; best shown):", "",
          "| role | M | best us | TB/s | cuBLAS us |", "|---|---|---|---|---|"]
    for role in r["best"]:
        for M in (1, 64):
            xs = sorted([x for x in timed if x["role"] == role and x["M"] == M], key=lambda x: x["us_per_launch"])
            if xs:
                cb = r["cublas"].get(f"{role}/M{M}", {})
                L.append(f"| {role} | {M} | {xs[0]['us_per_launch']:.2f} | {xs[0]['bytes_per_s'] / 1e12:.2f} | "
                         f"{cb.get('us_per_launch', float('nan')):.2f} |")
    L += ["", "Single-iteration tiles with many programs (4-8 per SM, SPLIT up to 24, first slice in registers "
          "before the PDL wait) were 1.7-2.8x slower than the best (e.g. down 28.7 us, xy 22.9 us, logits 94.9 us): "
          "the best have a few hundred programs, each pipelining 512-2048 of K.", "",
          "Engine step (rglru, B = 16) inside the sweep's call (\"split\": the best tiles after the grid or "
          "after the neighbours; \"default\": that commit's first split-K heuristic, about 528 programs of "
          "128-wide K slices, since replaced by these tiles): " + ", ".join(
              f"{x['variant']} after {x['after']}: {x['timing']['median_ms']:.3f} ms" for x in r["step"]), ""]
    return L


def limits_report(folder: Path, tag: str, h: str = "## ") -> list:
    """Where the B = 16 step's time goes against the 0.8 ms target (from the run's files)."""
    r = json.loads((folder / f"generation_h200{tag}.json").read_text())
    prof = json.loads((folder / f"generation_h200{tag}_profile.json").read_text())
    bw = r["copy_bandwidth"]["bytes_per_s"]
    L = [f"{h}What limits the B = 16 step (measured)", ""]
    best = {}
    for x in r["step"]:
        k = x["mixer"]
        if k not in best or x["timing"]["median_ms"] < best[k][1]:
            best[k] = (x["variant"], x["timing"]["median_ms"])
    L.append("Fastest step per mixer: " + ", ".join(f"{m} {v} {t:.3f} ms" for m, (v, t) in best.items())
             + f"; target 0.8 ms: {'met' if all(t <= 0.8 for _, t in best.values()) else 'not met'}; floor "
             + ", ".join(f"{m} {v:.3f} ms" for m, v in r["floor_ms"].items()) + ".")
    for p in prof["profiles"]:
        if p["variant"] != "gemm+graph" or not p["linear_roles"]:
            continue
        lin = p["by_category_us"].get("weight-streaming linear (ours)", 0.0)
        n_layers = r["shapes"]["layers"]
        wbytes = sum(v["weight_bytes"] * (1 if k == "logits" else n_layers) for k, v in p["linear_roles"].items())
        excess = {k: v["mean_us"] - v["weight_bytes"] / bw * 1e6 for k, v in p["linear_roles"].items()}
        per_step_excess = sum(v * (1 if k == "logits" else n_layers) for k, v in excess.items())
        L += ["", f"rglru gemm+graph (profiled eagerly, kernel times): graph step {p['graph_step_median_us']:.0f} us, "
              f"kernel sum {p['kernel_us_per_step']:.0f} us in {p['launches_per_step']:.0f} launches (so "
              f"{p['graph_step_median_us'] - p['kernel_us_per_step']:.0f} us between kernels). Linears "
              f"{lin:.0f} us for {wbytes / 1e9:.2f} GB of weights ({wbytes / bw * 1e6:.0f} us at the copy bandwidth); "
              f"of the rest: " + ", ".join(f"{k} {v:.0f} us" for k, v in p["by_category_us"].items()
                                         if k != "weight-streaming linear (ours)") + ".",
              "Each linear launch takes longer than its bytes at the copy bandwidth by: " + ", ".join(
                  f"{k} {v:.1f} us" for k, v in excess.items())
              + f" -- {per_step_excess:.0f} us per step, the largest part of the gap to the floor. cuBLAS at the same "
              "shapes pays a fixed cost of similar size per launch (section 4, last column; ours is larger for xy and "
              "up, whose launches also do the RMSNorm, GeLU, conv and gating that cuBLAS leaves to row kernels). "
              "What makes up that cost was not taken apart (no hardware counters read); the candidates are the "
              "ramp-up of a launch that depends on the previous one, the tail of its last wave and, with SPLIT > 1, "
              "the serial tail of the last program of each column block (partials stored, release, count, partials "
              "read back, epilogue). "
              "An L2 prefetch of the next launch's weights before its PDL wait (variants +pf, +pf+early) made the step "
              "slower (table above)."]
    L += ["", "Beyond this (not done here): one persistent kernel per layer or per step that prefetches the next "
          "linear's weights while the previous one's reductions finish (grid-wide flags instead of launch "
          "boundaries), and the mixer step fused into the xy linear's last-arriving programs (it costs a launch "
          "and ~4.6 us per layer, owned by the mixer kernels).", ""]
    return L


def report_run2(folder: Path) -> str:
    """summary.md: run 2 (split-K linears) in full, then run 1 (the first run's summary)."""
    r1 = json.loads((folder / "generation_h200.json").read_text())
    r2 = json.loads((folder / "generation_h200_run2.json").read_text())
    L = ["# Generation on the NVIDIA H200 (generated by bench_generate.py --report --tag _run2)", "",
         "Two runs are kept: run 2 (split-K weight-streaming linears, this summary's sections 1-4; files *_run2*, "
         "linear_sweep*) and run 1 (files without a suffix; its generated summary is summary_run1.md).", "",
         "## 1. Step at B = 16 across runs (median ms, AB order)", "",
         "| mixer | variant | run 1 | run 2 |", "|---|---|---|---|"]
    med = {}
    for run, r in (("1", r1), ("2", r2)):
        for x in r["step"]:
            if x["order"] == "AB":
                med.setdefault((x["mixer"], x["variant"]), {})[run] = x["timing"]["median_ms"]
    for (mx, v), d in med.items():
        L.append(f"| {mx} | {v} | {d.get('1', float('nan')):.3f} | {d.get('2', float('nan')):.3f} |")
    p1 = {(x["mixer"], x["B"]): x.get("tokens_per_s") for x in r1["throughput_probe"]}
    p2 = {(x["mixer"], x["B"]): x.get("tokens_per_s") for x in r2["throughput_probe"]}
    L += ["", "Batch sizes past 16 (64-step probes, tokens/s; run 1 stepped with fused kernels, run 2 with gemm up "
          "to B = 64): " + "; ".join(f"{mx} B={B}: run 1 {p1.get((mx, B)) or 0:.0f}, run 2 {p2.get((mx, B)) or 0:.0f}"
                                     for mx in MIXERS for B in (16, 32, 64)) + ". Hence the engine's auto choice: "
          "gemm up to B = 16, fused above.", ""]
    L += limits_report(folder, "_run2", "## 2. ")
    L += ["## 3. Run 2 in full", ""] + report(folder, "_run2", level="###").splitlines()[2:]
    L += [""] + sweep_report(folder, "## 4. ")
    L += ["## 5. Run 1", "", "See summary_run1.md (generated from generation_h200.json, "
          "generation_h200_profile.json at commit " + r1["env"]["commit"][:10] + ").", ""]
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=150.0, help="time for sections 3-7")
    ap.add_argument("--tests", action="store_true", help="run tests/test_generation_gpu.py alongside")
    ap.add_argument("--test-timeout", type=float, default=120.0)
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    ap.add_argument("--official", action="store_true", help="time the official sampler step (needs recurrentgemma)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of this script)")
    ap.add_argument("--profile", action="store_true", help="kernel-time breakdown of the step (second call)")
    ap.add_argument("--tag", default="", help="suffix of the result files' names (e.g. _run2)")
    ap.add_argument("--sweep", action="store_true", help="microbenchmark of the split-K linear's tiles")
    ap.add_argument("--report", action="store_true", help="write summary.md from the result files in --out")
    a = ap.parse_args(argv)
    if a.report:
        text = report_run2(Path(a.out)) if a.tag == "_run2" else report(Path(a.out), a.tag)
        (Path(a.out) / "summary.md").write_text(text)
        return None
    S = SMOKE if a.smoke else FULL
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.profile:
        return profile_main(a, S, out_dir, device)
    if a.sweep:
        return sweep_main(a, S, out_dir, device)
    cuda = device.type == "cuda"
    VARIANTS.update(variants_for(HawkConfig.preset(S["preset"])))
    variants = list(VARIANTS) if cuda else ["model+graph", "gemm+graph"]
    res = {"schema": "generation-bench/1", "env": env_facts(a.commit), "settings": S, "variants": VARIANTS,
           "gate": {}, "step": [], "selected": {}, "latency": [], "throughput_probe": [], "throughput": [],
           "cut": [], "errors": []}
    path = out_dir / f"generation_{'smoke' if a.smoke else 'h200'}{a.tag}.json"

    def save():
        clean = json.loads(json.dumps(res, default=lambda o: None))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(clean, indent=1))
        tmp.replace(path)

    tests = None
    if a.tests:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        tests = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rA", "-s", "tests/test_generation_gpu.py"],
                                 cwd=REPO, stdout=open(out_dir / f"gpu_tests{a.tag}.log", "w"), stderr=subprocess.STDOUT,
                                 env=env)
        log("GPU tests started")

    pool, pool_result = None, None
    tasks = compile_tasks({v: VARIANTS[v] for v in variants}, S["batches"])
    if cuda:
        import multiprocessing as mp

        n = max(1, min(12, (os.cpu_count() or 4) - 3, len(tasks)))
        pool = mp.get_context("spawn").Pool(n)
        pool_result = pool.map_async(compile_worker, [(S["preset"], tasks[i::n], "cuda") for i in range(n)])
        log(f"compiling {len(tasks)} linear specialisations in {n} processes")
    else:
        compile_worker((S["preset"], tasks[:2], "cpu"))

    models = {mx: build(S["preset"], mx, device) for mx in MIXERS}
    cfg = models["rglru"].config
    res["shapes"] = {"preset": S["preset"], "width": cfg.width, "layers": cfg.num_layers, "lru_width": cfg.lru_width,
                     "mlp": cfg.mlp_expanded_width, "vocab": cfg.vocab_size, "dtype": "bfloat16",
                     "param_bytes": {mx: param_bytes(m) for mx, m in models.items()}}

    # ---- 2. correctness gate (and graph captures for B) while the tests run
    engines = {}
    for mx in MIXERS:
        m = models[mx]
        m32 = copy.deepcopy(m).float()
        yard = copy.deepcopy(m).set_backend("reference")
        res["gate"][mx] = []
        for v in ["model-eager", *variants]:
            t0 = time.perf_counter()
            try:
                r = gate(m, m32, yard, v, S["B"], S["gate_prompt"], S["gate_steps"], device)
                engines[(mx, v)] = r.pop("_engine")
                r["seconds"] = time.perf_counter() - t0
                res["gate"][mx].append(r)
                log(f"gate {mx} {v}: error {r['error']:.3g} (bf16 PyTorch {r['bf16_pytorch_error']:.3g}, tolerance "
                    f"{r['tolerance']:.3g}) {'PASS' if r['passed'] else 'FAIL'}; argmax agreement "
                    f"{r['argmax_agreement_with_fp32']:.3f} [{r['seconds']:.1f} s]")
            except Exception as e:  # noqa: BLE001
                res["gate"][mx].append({"variant": v, "passed": False, "error_text": traceback.format_exc()})
                log(f"gate {mx} {v}: ERROR {e!r}")
        del m32, yard
        torch.cuda.empty_cache() if cuda else None
        save()
    passed = {mx: [g["variant"] for g in res["gate"][mx] if g.get("passed") and g["variant"] in variants]
              for mx in MIXERS}
    # Logical counts of one step (Triton launchers' accounting; library matmuls are not
    # counted), and a warm-up that compiles every kernel specialisation the timed
    # sections use (batch sizes with other tile shapes, the long prefill).
    t0 = time.perf_counter()
    res["logical"] = {}
    long_prompt = None
    if max(S["prompts"]):
        P = max(S["prompts"])
        long_prompt = torch.randint(3, cfg.vocab_size, (S["B"], P), generator=torch.Generator().manual_seed(11))
        long_prompt[:, 0] = 2
    for mx in MIXERS:
        res["logical"][mx] = {}
        for v in passed[mx]:
            opts = dict(VARIANTS[v], graphs=False)
            try:
                e = Engine(models[mx], **opts)
                for B in sorted({S["B"], *[b for b in S["batches"] if b in (1, 4, 32, 64, 128)]}):
                    e.start(batch_size=B)
                    with accounting.counting() as c:
                        e.step()
                    if B == S["B"]:
                        res["logical"][mx][v] = {**c.as_dict(), "basis": "Triton launchers only (not cuBLAS, "
                                                 "not PyTorch ops)", "param_bytes": res["shapes"]["param_bytes"][mx]}
                del e
            except Exception as e:  # noqa: BLE001
                res["errors"].append({"section": "warm-up", "mixer": mx, "variant": v, "error": traceback.format_exc()})
                log(f"warm-up {mx} {v}: ERROR {e!r}")
        if long_prompt is not None and passed[mx]:
            engines[(mx, passed[mx][0])].start(long_prompt)
    if cuda:
        torch.cuda.synchronize()
    log(f"warm-up (compilation) [{time.perf_counter() - t0:.1f} s]")
    if pool is not None:
        try:
            got = pool_result.get(timeout=max(1.0, a.test_timeout))
            res["compile"] = {"tasks": len(tasks), "done": sum(d for d, _ in got),
                              "failed": [f for _, fs in got for f in fs]}
        except Exception as e:  # noqa: BLE001
            res["compile"] = {"tasks": len(tasks), "error": repr(e)}
        pool.terminate()
        log(f"compile pool: {res['compile']}")
    if tests is not None:
        try:
            rc = tests.wait(timeout=max(1.0, a.test_timeout))
        except subprocess.TimeoutExpired:
            tests.kill()
            rc = "timeout"
        tail = (out_dir / f"gpu_tests{a.tag}.log").read_text().strip().splitlines()[-3:]
        res["tests"] = {"returncode": rc, "summary": tail}
        log(f"GPU tests: rc={rc}: {tail[-1] if tail else ''}")
        save()

    budget = Budget(a.budget_s)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    # ---- 3. copy bandwidth and the floor
    res["copy_bandwidth"] = copy_bandwidth(S["copy_bytes"], device)
    bw = res["copy_bandwidth"]["bytes_per_s"]
    res["floor_ms"] = {mx: res["shapes"]["param_bytes"][mx] / bw * 1e3 for mx in MIXERS}
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s; weight-streaming floor "
        + ", ".join(f"{mx} {res['floor_ms'][mx]:.3f} ms" for mx in MIXERS))

    # ---- 4. decode step at B, every passed variant, both orders
    combos = [(mx, v) for mx in MIXERS for v in passed[mx]]
    for order, seq in (("AB", combos), ("BA", combos[::-1])):
        for mx, v in seq:
            if order == "BA" and budget.left() < 0.75 * a.budget_s:
                res["cut"].append({"section": "step", "mixer": mx, "variant": v, "order": order, "reason": "budget"})
                continue
            eng = engines[(mx, v)]
            eng.start(batch_size=S["B"])
            t = timing.time_fn(eng.step, reps=S["step_reps"], warmup=5, device=device)
            rec = {"mixer": mx, "variant": v, "order": order, "B": S["B"], "prompt": 0, "timing": t,
                   "tokens_per_s": S["B"] / (t["median_ms"] * 1e-3), "describe": eng.describe(S["B"]),
                   "floor_ms": res["floor_ms"][mx]}
            res["step"].append(rec)
            log(f"step {order} {mx:5s} {v:15s} B={S['B']}: median {t['median_ms']:.3f} ms (p10 {t['p10_ms']:.3f}, "
                f"p95 {t['p95_ms']:.3f}); floor {res['floor_ms'][mx]:.3f} ms")
    save()
    for mx in MIXERS:
        meds = {}
        for r in res["step"]:
            if r["mixer"] == mx:
                meds.setdefault(r["variant"], []).append(r["timing"]["median_ms"])
        if meds:
            best = min(meds, key=lambda k: max(meds[k]))
            res["selected"][mx] = {"variant": best, "by": "lowest worst-order median step time at B",
                                   "medians_ms": meds}
    log("selected: " + ", ".join(f"{mx} {s['variant']}" for mx, s in res["selected"].items()))
    sel = {mx: engines[(mx, s["variant"])] for mx, s in res["selected"].items()}
    save()

    # ---- 5. official sampler step
    if a.official and "rglru" in sel:
        try:
            eng = sel["rglru"]
            eng.start(torch.tensor([[2, 3]] * S["B"]))
            ours = torch.stack([eng.step().clone() for _ in range(12)], 1)
            res["official"] = official_step(models["rglru"], S["B"], S["official_reps"], device, ours)
            log(f"official sampler step B={S['B']}: median {res['official']['timing']['median_ms']:.2f} ms; greedy "
                f"agreement with ours (first 12) {res['official'].get('greedy_token_agreement_first12')}")
        except Exception as e:  # noqa: BLE001
            res["errors"].append({"section": "official", "error": traceback.format_exc()})
            log(f"official: ERROR {e!r}")
        torch.cuda.empty_cache() if cuda else None
        save()

    # ---- 6. latency
    mixers = [mx for mx in MIXERS if mx in sel]
    per_step_guess = {mx: max(r["timing"]["median_ms"] for r in res["step"]
                              if r["mixer"] == mx and r["variant"] == res["selected"][mx]["variant"])
                      for mx in mixers}
    n_lat = max(S["lengths"])
    for P in S["prompts"]:
        prompt = long_prompt if P else None
        if P and P != long_prompt.shape[1]:
            prompt = torch.randint(3, cfg.vocab_size, (S["B"], P), generator=torch.Generator().manual_seed(11))
            prompt[:, 0] = 2
        for order, seq in (("AB", mixers), ("BA", mixers[::-1])):
            for mx in seq:
                need = per_step_guess[mx] * n_lat / 1e3 + (3.0 if P else 0.5)
                if budget.left() < need:
                    res["cut"].append({"section": "latency", "mixer": mx, "prompt": P, "order": order,
                                       "reason": f"budget: {budget.left():.0f} s left, about {need:.0f} s needed"})
                    log(f"latency P={P} {order} {mx}: cut (budget)")
                    continue
                eng = sel[mx]
                before = (lambda e=eng, p=prompt: (e.start(p) if p is not None else e.start(batch_size=S["B"])))
                try:
                    tr = timing.time_trajectory(lambda i, e=eng: e.step(), S["lengths"], device, before=before)
                except Exception as e:  # noqa: BLE001
                    res["errors"].append({"section": "latency", "mixer": mx, "prompt": P,
                                          "error": traceback.format_exc()})
                    log(f"latency P={P} {mx}: ERROR {e!r}")
                    continue
                rec = {"mixer": mx, "variant": res["selected"][mx]["variant"], "order": order, "B": S["B"],
                       "prompt": P, "trajectory": tr,
                       "ms_per_step": [c / n for c, n in zip(tr["cumulative_ms"], tr["checkpoints"])],
                       "tokens_per_s": [S["B"] * n / (c * 1e-3) for c, n in zip(tr["cumulative_ms"], tr["checkpoints"])]}
                res["latency"].append(rec)
                log(f"latency P={P} {order} {mx}: " + ", ".join(
                    f"{n}: {c:.0f} ms" for n, c in zip(tr["checkpoints"], tr["cumulative_ms"])))
                save()

    # ---- 7. throughput: probes, then fresh trajectories of the best batch
    probe = {mx: {} for mx in mixers}
    for B in S["batches"]:
        for mx in mixers:
            if budget.left() < 8:
                res["cut"].append({"section": "throughput_probe", "mixer": mx, "B": B, "reason": "budget"})
                continue
            eng = sel[mx]
            try:
                eng.start(batch_size=B)
                eng.step()      # capture for this batch size (excluded)
                sync()
                tr = timing.time_trajectory(lambda i, e=eng: e.step(), [S["probe_steps"]], device,
                                            before=lambda e=eng, b=B: e.start(batch_size=b))
                tps = B * S["probe_steps"] / (tr["cumulative_ms"][0] * 1e-3)
                probe[mx][B] = tps
                res["throughput_probe"].append({"mixer": mx, "B": B, "steps": S["probe_steps"], "trajectory": tr,
                                                "tokens_per_s": tps, "kernels": eng.describe(B)["kernels"],
                                                "status": "ok"})
                log(f"probe {mx} B={B}: {tr['cumulative_ms'][0] / S['probe_steps']:.3f} ms/step, {tps:.0f} tokens/s")
            except torch.cuda.OutOfMemoryError:
                res["throughput_probe"].append({"mixer": mx, "B": B, "status": "out of memory"})
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                res["throughput_probe"].append({"mixer": mx, "B": B, "status": "error", "error": traceback.format_exc()})
                log(f"probe {mx} B={B}: ERROR {e!r}")
    save()
    best = {mx: max(probe[mx], key=probe[mx].get) for mx in mixers if probe[mx]}
    res["selected_batch"] = {mx: {"B": b, "by": "highest probe tokens/s", "probe_tokens_per_s": probe[mx]}
                             for mx, b in best.items()}
    log("best batch: " + ", ".join(f"{mx} B={b}" for mx, b in best.items()))
    bm = list(best)
    for order, seq in (("AB", bm), ("BA", bm[::-1])):
        for mx in seq:
            B = best[mx]
            ms = B * 1.0 / probe[mx][B] * 1e3         # ms per step from the probe
            lengths = [n for n in S["thr_lengths"] if ms * n / 1e3 + 1.0 < budget.left()]
            if not lengths:
                res["cut"].append({"section": "throughput", "mixer": mx, "order": order, "B": B, "reason": "budget"})
                log(f"throughput {order} {mx}: cut (budget)")
                continue
            if lengths != S["thr_lengths"]:
                res["cut"].append({"section": "throughput", "mixer": mx, "order": order, "B": B,
                                   "reason": f"budget: trajectory to {max(lengths)} instead of {max(S['thr_lengths'])}"})
            eng = sel[mx]
            tr = timing.time_trajectory(lambda i, e=eng: e.step(), lengths, device,
                                        before=lambda e=eng, b=B: e.start(batch_size=b))
            rec = {"mixer": mx, "B": B, "order": order, "trajectory": tr, "kernels": eng.describe(B)["kernels"],
                   "tokens_per_s": [B * n / (c * 1e-3) for c, n in zip(tr["cumulative_ms"], tr["checkpoints"])]}
            res["throughput"].append(rec)
            log(f"throughput {order} {mx} B={B}: " + ", ".join(
                f"{n}: {t:.0f} tok/s" for n, t in zip(tr["checkpoints"], rec["tokens_per_s"])))
            save()

    # ---- summary table
    log("\nsummary (medians; B=%d; floor = parameter bytes / copy bandwidth)" % S["B"])
    for mx in MIXERS:
        for r in res["step"]:
            if r["mixer"] == mx and r["order"] == "AB":
                log(f"  {mx:5s} {r['variant']:15s} {r['timing']['median_ms']:.3f} ms/step  floor {r['floor_ms']:.3f}")
    if "official" in res:
        log(f"  official sampler step: {res['official']['timing']['median_ms']:.2f} ms")
    res["budget_left_s"] = budget.left()
    save()
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
