"""Predicted GPU time per stage of a profile, printed when the Snakefile is parsed: a
fixed part plus, per configuration, set-up and timed calls (work under 50 ms per call
is timed on two clocks, so counts twice). The constants are H200 figures from the runs
named in CALIBRATION (tests/test_pipeline.py checks them); option grids err high."""

from __future__ import annotations

import itertools
import math

CALIBRATION = "H200, runs h200-20261201-run3, -run4-partial, h200-20261202-run6 and -run7-h800"

# Whole-stage figures (s); the audit scales with its dtypes.
PROBE_S = 18.0
AUDIT_S_PER_DTYPE = 132.0
# The captured training-step gate (tiny preset, both mixers, eager and captured): 25 s in
# FP32 with the kernels' first compile, 12 s in BF16, on an H200 (a direction check).
AUDIT_CAPTURED_TRAIN_S = 18.0
# Each decode step option set of the tune grid, gated in the audit: the compiles of its
# variants (with and without resets, SAMU's with and without the mode table), per dtype;
# an estimate at about 1 s a compile (the tune stage then finds them compiled).
AUDIT_STEP_OPTION_SET_S = 2.5
AGGREGATE_S = 17.0
ARCHIVE_S = 5.0
# Process start to first configuration, without the configurations (s).
FIXED_S = {"tune": 12.0, "scan": 10.0, "train": 9.0, "infer": 13.0, "ops": 10.0}

TWO_CLOCKS_BELOW_MS = 50.0   # measure.DEVICE_CLOCK_MAX_MS
EAGER_WARM_MS = 30.0         # measure.EAGER_WARM_MS: calls under it run back to back this long first

# ---- tune: a candidate compiles and is checked in ~1.5 s; a decode candidate in ~0.4 s.
TUNE_CANDIDATE_S = 1.5
TUNE_REFERENCE_S = 2.0          # the reference result each shape's candidates are checked against
TUNE_DECODE_CANDIDATE_S = 0.4
# One decode step of one layer at D = 2560 with its state out of cache (ms) against B: an
# estimate of the H200 steps (about 5 us at B <= 64, 14 us at B = 512); a candidate runs
# warmup + trajectories (+ a fresh run for the winner) trajectories of steps x layers.
TUNE_DECODE_LAYER_STEP_MS = (0.004, 0.00002)
# Fastest exact call per element (B*T*D), ms: run 4's probe medians (rglru and samu
# fwd_bwd at B=4 T=2048 D=2560, scan fwd at B=8 T=4096 D=1024); assoc is ~16x slower.
TUNE_MS_PER_ELEMENT = {("rglru", "fwd_bwd"): 0.75 / 20.97e6, ("samu", "fwd_bwd"): 2.2 / 20.97e6,
                       ("scan", "fwd_bwd"): 0.6 / 20.97e6, ("rglru", "fwd"): 0.2 / 33.55e6,
                       ("samu", "fwd"): 0.6 / 33.55e6, ("scan", "fwd"): 0.2 / 33.55e6}
TUNE_ASSOC_FACTOR = 16.0
# The decode linears, per candidate besides its trajectories: a compile of its tiles, an
# engine built and captured, an eager twin's step counted (run 14: 45 candidates and 5
# fresh runs in 36 s, trajectories included).
TUNE_LINEAR_CANDIDATE_S = 0.6
TUNE_LINEAR_MODEL_S = 5.0
LINEAR_ROLES = 5
OP_BACKENDS = dict.fromkeys(("rglru", "samu", "scan"), ("serial", "chunk", "assoc"))
STEP_BACKENDS = {"rglru": ["fused"], "samu": ["fused", "row", "blocked"]}

# ---- scan track: forward at B=8, T=2048, D=1024 (ms, run 3 and 4 medians); linear in B*T*D.
SCAN_ELEMENTS = 8 * 2048 * 1024
SCAN_MS = {
    "rglru": {"serial": 0.10, "chunk": 0.17, "assoc": 4.3, "assoc_bf16": 6.2, "reference": 62.0},
    "samu": {"serial": 0.86, "chunk": 0.5, "assoc": 3.2, "assoc_bf16": 5.1, "reference": 65.0},
    "scan": {"serial": 0.10, "chunk": 0.17, "assoc": 3.7, "assoc_bf16": 5.6, "reference": 105.0},
}
SCAN_CONFIG_S = 0.5
SCAN_COUNTERS_S = 1.8            # Nsight Compute pass, per configuration it profiles
SCAN_COUNTERS_SKIP = ("reference", "assoc", "assoc_bf16")

# ---- train track: one step of 8192 tokens (s), the mean of run 6's fresh medians over both
# mixers and the three shapes; T-independent except for the per-step loops, which are
# linear in T and in the number of layers.
TRAIN_STEP_S = {"400m": 0.076, "1.3b": 0.196, "tiny": 0.01}
TRAIN_BUILD_S = {"400m": 1.2, "1.3b": 2.3, "tiny": 0.2}
TRAIN_FACTOR = {"assoc": 2.5, "assoc_bf16": 2.9}
TRAIN_ASSOC_BUILD_S = 2.7
TRAIN_LAYERS = {"400m": 12, "1.3b": 24, "tiny": 2}
TRAIN_LOOP_S_PER_LAYER_STEP = 4.83 / (12 * 2048)   # reference loop: 4.83 s at 400m, T = 2048
TRAIN_LOOP_COUNT_FACTOR = 20.0   # counting launches of a per-step loop costs ~20 steps (run 3)
TRAIN_DIAG_BACKENDS = ["serial", "chunk", "assoc", "assoc_bf16"]

# ---- infer track: 1.3b BF16 decode step with CUDA graphs (ms) against B, the mean of the
# two mixers' 64-step probes in run 6.
INFER_STEP_MS = [(1, 1.40), (16, 1.44), (64, 2.0), (128, 2.08), (256, 2.4), (512, 3.57), (1024, 6.0),
                 (2048, 11.0), (4096, 21.3), (8192, 43.5)]
INFER_BUILD_S = 3.0              # one model built (and its graph captured) per configuration
INFER_PREFILL_S_PER_TOKEN_ROW = 0.5 / (4096 * 16)
INFER_PROBE_S = 0.5


def _grid_size(grids: dict, op: str, name: str) -> int:
    found = grids.get(f"{op}/{name}", grids.get(name, grids.get("*", {}))) or {}
    return sum(math.prod(len(v) for v in g.values()) for g in (found if isinstance(found, list) else [found]))


def _calls(warmup: int, reps: int, ms: float) -> float:
    warm = EAGER_WARM_MS if ms < EAGER_WARM_MS else 0.0
    return ((warmup + reps) * ms * (2 if ms < TWO_CLOCKS_BELOW_MS else 1) + warm) / 1e3


def tune(s: dict) -> float:
    total = FIXED_S["tune"]
    reps, warmup, fresh = s["reps"], s.get("warmup", 0), s["fresh_reps"]
    grids = s.get("options", {})
    for op, shapes in s.get("shapes", {}).items():
        mode = s.get("modes", {}).get(op, "fwd_bwd")
        names = [n for n in OP_BACKENDS[op] if not s.get("backends") or n in s["backends"]]
        n_cand = sum(_grid_size(grids, op, n) for n in names if n != "assoc")
        n_assoc = int("assoc" in names)
        n_cand = min(n_cand, s.get("max_candidates", n_cand + n_assoc))
        for sh in shapes:
            ms = TUNE_MS_PER_ELEMENT[(op, mode)] * sh["B"] * sh["T"] * sh["D"]
            total += TUNE_REFERENCE_S + n_cand * (TUNE_CANDIDATE_S + _calls(warmup, reps, ms))
            total += n_assoc * (TUNE_CANDIDATE_S + _calls(warmup, reps, ms * TUNE_ASSOC_FACTOR))
            total += _calls(warmup, fresh, ms)
    dec = s.get("decode")
    if dec:
        for op, names in STEP_BACKENDS.items():
            n = sum(_grid_size(dec.get("options", {}), op, name) for name in names)
            total += len(dec["batches"]) * (n + 1) * TUNE_DECODE_CANDIDATE_S
            a, b = TUNE_DECODE_LAYER_STEP_MS
            walks = (dec.get("warmup", 2) + dec["trajectories"]) * dec["steps"] * dec.get("layers", 1)
            total += sum((n + 1) * walks * (a + b * B) / 1e3 for B in dec["batches"])
    lin = s.get("linears")
    if lin:
        n = math.prod(len(v) for v in lin.get("options", {}).values()) + 1
        if lin.get("refine"):       # the winner and each refine combination, and a second fresh run
            n += math.prod(len(v) for v in lin["refine"].values()) + 2
        steps = (lin.get("warmup", 2) + lin["trajectories"] * lin["steps"]) * (n + 1) * LINEAR_ROLES
        total += TUNE_LINEAR_MODEL_S + LINEAR_ROLES * (n + 1) * TUNE_LINEAR_CANDIDATE_S \
            + steps * infer_step_ms(lin["batch"], lin["preset"]) / 1e3
    return total


def scan(s: dict) -> float:
    configs = []
    n_chunk = max(len(s.get("chunk_sizes", [])), 1)
    orders = len(s.get("orders", ["AB", "BA"]))
    slow = s.get("slow", {})
    counted = 0
    for T in s["T"]:
        scale = s["B"] * T * s["D"] / SCAN_ELEMENTS
        for op in s["ops"]:
            for name, ms in SCAN_MS[op].items():
                if (not s.get("backends") or name in s["backends"]) and \
                        (name != "reference" or T <= s.get("reference_max_T", 0)):
                    n, per = n_chunk if name == "chunk" else 1, slow.get(name, {})
                    calls = _calls(per.get("warmup", s["warmup"]), per.get("reps", s["reps"]), ms * scale)
                    configs += [SCAN_CONFIG_S + calls] * (orders * n)
                    counted += n * (name not in SCAN_COUNTERS_SKIP)
    counters = SCAN_COUNTERS_S * counted if s.get("counters") else 0.0
    return FIXED_S["scan"] + counters + _budgeted(configs, s.get("budget_s"))


def _train_step(preset: str, name: str, T: int) -> float:
    if name in ("reference", "official"):
        return TRAIN_LOOP_S_PER_LAYER_STEP * TRAIN_LAYERS.get(preset, 24) * T
    return TRAIN_STEP_S.get(preset, TRAIN_STEP_S["1.3b"]) * TRAIN_FACTOR.get(name, 1.0)


def _train_config(preset: str, name: str, T: int, warmup: int, reps: int, count: bool, count_T=None) -> float:
    step = _train_step(preset, name, T)
    build = TRAIN_BUILD_S.get(preset, TRAIN_BUILD_S["1.3b"]) + (TRAIN_ASSOC_BUILD_S if "assoc" in name else 0)
    loop = name in ("reference", "official")
    if count and loop and count_T:     # counted at two short lengths: a build, a warm-up and a count each
        counting = sum(build + (1 + TRAIN_LOOP_COUNT_FACTOR) * _train_step(preset, name, t) for t in count_T)
    else:
        counting = (TRAIN_LOOP_COUNT_FACTOR if loop else 1.0) * step if count else 0.0
    return build + (warmup + reps) * step + counting


def train(s: dict) -> float:
    shapes = [(p, sh["T"], sh["B"]) for p in s["presets"] for sh in s["shapes"]]
    diag = s.get("diagnostics", "all")
    diag_shapes = shapes if diag == "all" else [(d["preset"], d["T"], d["B"]) for d in diag]
    orders = s.get("diagnostic_orders", ["AB", "BA"])
    names = [n for n in TRAIN_DIAG_BACKENDS if not s.get("backends") or n in s["backends"]]
    ref, off = s.get("reference", {}), s.get("official", {})
    configs = []
    for preset, T, _B in diag_shapes:
        for mixer in s["mixers"]:
            for name in names:
                configs += [_train_config(preset, name, T, s["warmup"], s["reps"], o == "AB") for o in orders] \
                    * (len(s.get("chunk_sizes", [])) if name == "chunk" else 1)
            if (not s.get("backends") or "reference" in s["backends"]) and preset in ref.get("presets", []) \
                    and T <= ref.get("max_T", 0):
                configs += [_train_config(preset, "reference", T, ref.get("warmup", 1), ref.get("reps", 1), o == "AB",
                                          s.get("loop_count_T")) for o in orders]
        if "rglru" in s["mixers"] and preset in off.get("presets", []) and T <= off.get("max_T", 0):
            configs.append(_train_config(preset, "official", T, off.get("warmup", 1), off.get("reps", 2), True,
                                         s.get("loop_count_T")))
    for preset, T, _B in shapes:     # a captured step: its capture costs about one more step
        configs += [_train_config(preset, "chunk", T, s["warmup"] + (mode == "graph"), s["fresh_reps"], o == "AB")
                    for o in ("AB", "BA") for mode in s.get("step_modes", ["eager"])] * len(s["mixers"])
    return FIXED_S["train"] + _budgeted(configs, s.get("budget_s"))


def _budgeted(configs: list[float], budget: float | None) -> float:
    """A stage with a time budget starts no configuration after the budget is spent."""
    totals = itertools.accumulate(configs, initial=0.0)
    return sum(configs) if budget is None else next((t for t in totals if t >= budget), sum(configs))


def infer_step_ms(B: int, preset: str = "1.3b") -> float:
    """Step time at batch B: linear between run 6's points and beyond the last two (the
    weight read is paid once, the per-row work grows with B)."""
    pts = INFER_STEP_MS
    if B <= pts[0][0]:
        ms = pts[0][1]
    else:
        (b0, m0), (b1, m1) = next(((p, q) for p, q in zip(pts, pts[1:]) if B <= q[0]), (pts[-2], pts[-1]))
        ms = m0 + (m1 - m0) * (B - b0) / (b1 - b0)
    return ms * (1.0 if preset == "1.3b" else TRAIN_STEP_S.get(preset, 0.27) / TRAIN_STEP_S["1.3b"])


def infer_grid(thr: dict, preset: str = "1.3b") -> list[int]:
    """The batch sizes the throughput probes reach: the profile's, then doublings while
    the modelled tokens/s rises by more than plateau_rise (track_infer.extend_grid)."""
    batches, rise, cap = sorted(thr["batches"]), thr.get("plateau_rise", 0.02), thr.get("max_batch", 8192)
    while 2 * batches[-1] <= cap:
        B = batches[-1]
        batches.append(2 * B)
        if 2 * B / infer_step_ms(2 * B, preset) <= (1 + rise) * B / infer_step_ms(B, preset):
            break   # the probe at 2B shows the plateau; B stays the best
    return batches


def infer_best(batches: list[int], preset: str = "1.3b") -> int:
    return max(batches, key=lambda b: b / infer_step_ms(b, preset))


def infer(s: dict) -> float:
    total = FIXED_S["infer"]
    mixers, preset = len(s["mixers"]), s["preset"]
    lat = s["latency"]
    warm = s.get("warmup_steps", 2)
    step = infer_step_ms(lat["batch"], preset) / 1e3
    for prompt in lat["prompts"]:
        per = INFER_BUILD_S + prompt * lat["batch"] * INFER_PREFILL_S_PER_TOKEN_ROW
        per += (warm + lat.get("reps", 1) * max(lat["lengths"])) * step
        total += 2 * mixers * per
    pre = s.get("prefill")
    if pre:
        per = INFER_BUILD_S + (pre.get("reps", 3) + 2) * pre["prompt"] * pre["batch"] * INFER_PREFILL_S_PER_TOKEN_ROW
        total += 2 * mixers * per
    thr = s.get("throughput")
    if thr:
        batches = infer_grid(thr, preset)
        total += 2 * mixers * (INFER_BUILD_S + sum(INFER_PROBE_S + (warm + thr["probe_steps"])
                                                   * infer_step_ms(b, preset) / 1e3 for b in batches))
        best = infer_step_ms(infer_best(batches, preset), preset) / 1e3
        per = INFER_BUILD_S + (warm + thr.get("reps", 1) * max(thr["lengths"])) * best
        total += 2 * mixers * thr.get("top", 1) * per
    return total


# ---- ops track: a configuration is dominated by its float64 gate and graph capture, not by
# its calls (under 1 ms): run 5 wrote 68 records (80 planned) in 218 s at 5 + 50 calls each.
OPS_CONFIG_S = 1.4
OPS_CALL_S = 0.022
OPS_HOST_PROFILE_S = 0.1   # track_ops.HOST_PROFILE_CALLS calls under cProfile per short configuration
# The official RG-LRU layer (a PyTorch loop over T, eager) per call at B = 4, T = 2048
# (s, run 7 medians): without a per-configuration budget its calls dominate the track.
OPS_OFFICIAL_LAYER_S = {"fwd": 0.15, "fwd_bwd": 0.8}


def ops(s: dict) -> float:
    dec = s.get("decode") or {}
    calls = s.get("warmup", 0) + s["reps"]
    per = OPS_CONFIG_S + OPS_CALL_S * calls + OPS_HOST_PROFILE_S
    configs = []
    for op in s["ops"]:
        for mode in s.get("modes", ["fwd"]):
            n = 1 + (len(s.get("scan_peers", [])) if op == "scan" else 0)
            cost = n * per
            if op == "rglru_layer":     # ours, then the official layer's eager calls
                peer = OPS_CONFIG_S + OPS_OFFICIAL_LAYER_S[mode] * calls
                cost = per + min(peer, s.get("budget_s_per_config") or peer)
            configs += [cost] * (len(s["presets"]) * 2)
    # per batch: each step op, SAMU's also reading its mode table, each peer; both orders
    n_dec = len(dec.get("ops", [])) + ("samu" in dec.get("ops", [])) + len(dec.get("step_peers", []))
    configs += [per] * (n_dec * len(dec.get("batches", [])) * 2)
    return FIXED_S["ops"] + _budgeted(configs, s.get("budget_s"))


def estimate(profile: dict) -> dict[str, float | None]:
    """Predicted seconds per stage (None for a section the model does not cover)."""
    grids = (profile.get("tune") or {}).get("decode", {}).get("options", {})
    n_sets = sum(_grid_size(grids, *key.split("/")) for key in grids if "/" in key)
    out = {"probe": PROBE_S, "audit": (AUDIT_S_PER_DTYPE + AUDIT_CAPTURED_TRAIN_S * len(
               profile["audit"]["gates"].get("captured_train", [])) + AUDIT_STEP_OPTION_SET_S * n_sets)
           * len(profile["audit"]["dtypes"]),
           **{name: fn(profile[name]) for name, fn in (("tune", tune), ("ops", ops), ("scan", scan), ("train", train),
                                                         ("infer", infer)) if name in profile}}
    return {**out, **{n: None for n in profile if n not in out}, "aggregate": AGGREGATE_S, "archive": ARCHIVE_S}


def _fmt(s: float | None) -> str:
    return "not modelled" if s is None else f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def summary(name: str, profile: dict) -> str:
    """One line per stage and the total, for the console."""
    if (profile.get("audit") or {}).get("device") != "cuda":
        return f"predicted GPU time ({name}): none, the profile runs on the CPU"
    est = estimate(profile)
    total = sum(v for v in est.values() if v is not None)
    parts = ", ".join(f"{k} {_fmt(v)}" for k, v in est.items())
    return (f"predicted GPU time ({name}, {CALIBRATION}; workflow/scripts/common/cost.py): {parts}; "
            f"total {_fmt(total)}")
