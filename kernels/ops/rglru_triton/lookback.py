"""Single-pass chained forward and backward (decoupled look-back) for the bare scan and
the RG-LRU.

Opt-in only, as options of the chunk backend: fwd="lookback", chunk_size = L (a power of
two in [16, 256]), vec, window, block_d, num_warps (lookback_config); bwd="lookback" with
bwd_chunk, bwd_vec, bwd_warps, bwd_block_d (lookback_backward). Neither is a default, a
tuning-grid entry or an audit backend: on the H200 both ran correctly (no hang) but
slower than the serial kernels (results/kernels/rglru/README.md, third session: scan
forward 27-33% of the memory floor against 41-45% for serial; the one-pass backward
1.0-11 ms against 0.34 ms). Tested on the CPU interpreter (tests/test_lookback_triton.py).

Why: the chunk backend's forward reads its inputs twice (summary pass, then replay), so
the bare scan moves 10 bytes per element against a 6-byte floor (BF16 a, b, y). Here
every input element is read once and every output written once, plus a few FP32 words
per chunk and channel.

One launch. A program owns (chunk c of L steps, batch row b, channel block d). It
1. loads its [L, BD] tile once and forms the coefficients in registers (common.load_tile:
   resets give a_t = 0, rows past T are identity maps) and scans it from a zero state:
   (A_t, B_t) = the composition of the chunk's maps up to row t;
2. if c > 0, publishes its aggregate (A_L, B_L) with flag 1;
3. looks back over its predecessors, a window of W chunks (c - W .. c - 1, then the W
   before them, ...) per step: waits until every flag of the window is non-zero, then
   composes the window's maps in time order, an inclusive prefix s (flag 2: the true
   state at the end of that chunk) counting as the constant map z -> 0 z + s, which
   discards everything before it exactly. The look-back stops at the first window
   holding an inclusive prefix; chunk 0 always publishes one, and before chunk 0 the
   state is the initial state (or zero). The window's [W, BD] composition runs through
   tl.associative_scan (order-preserving; tl.reduce is not used for the non-commutative
   affine maps);
4. publishes its inclusive prefix A_L h_in + B_L with flag 2;
5. stores y_t = A_t h_in + B_t from registers, the final state if it owns the last chunk,
   and, under autograd, the states entering every sub-chunk of K steps that the chunk
   backward reads (S [B, ceil(T / K), D], K = cfg["K"] = min(L, 32), min(L, 16) with
   inner="loop"), so the existing chunk backward runs unchanged after this forward.
Workspaces per call: flags int32 [NC, ND, B] zeroed (plus one int32 ticket counter),
aggregates and inclusive prefixes FP32 [NC, B, D] (float64 for float64 inputs).

Tile layout (vec): 0 is Triton's default for a [L, BD] tile (time across lanes and warps:
the chunk's scan costs shuffles and shared memory); 2, 4, 8 give each thread vec whole
time columns of the chunk (common.channels), so the chunk's scan is a serial
loop in registers. For the serial backend this layout left too few threads (run 2);
here the chunks supply the parallelism (B * D / vec * NC threads).

Order of programs. Each program first takes a ticket, an atomic increment of one
counter; the ticket (not tl.program_id) is decoded as (chunk, batch row, channel block)
with the chunk slowest-varying, so every chunk-0 ticket comes first and a program only
ever waits on programs holding lower tickets. A program holding a ticket is resident;
the lowest unfinished ticket waits on nobody unfinished, so it runs to the end, and the
launch cannot deadlock whatever order the hardware dispatches program ids in (mapping
tl.program_id directly would rely on in-order dispatch, the usual assumption of
decoupled look-back, which CUDA does not document). The cost: one relaxed atomic on one
address per program.

Memory ordering (Triton 3.6 atomics: sem "acquire", "release", "acq_rel" (default) or
"relaxed"; scope "gpu" (default), "cta" or "sys"; tl.load cache_modifier ".cg" caches in
L2, not L1; tl.debug_barrier synchronises the program's threads):
- publish: plain stores of the [BD] data by the program's threads, tl.debug_barrier()
  (bar.sync: every thread's stores are ordered before what follows in the program),
  then tl.atomic_xchg(flag, v, sem="release") at gpu scope. Release is cumulative in
  the PTX memory model: stores ordered before it through the barrier become visible to
  any program that observes the new flag with an acquire operation.
- wait: tl.atomic_add(flags, 0, sem="acquire") in a loop until non-zero (an atomic read
  with acquire semantics: later loads of the program are ordered after it and the
  compiler may not hoist them). The window's data loads that follow use ".cg" (from
  L2, never a stale L1 line). Compiled for sm_90 on the CPU (Triton's ptxas), the
  kernel shows: st.global of the data, bar.sync, then `atom.global.gpu.release.exch`
  by one thread; each wait as `atom.global.gpu.acquire.add` by one thread per window
  element between two bar.sync (the values broadcast through shared memory), the
  minimum over the window by shuffles, then `ld.global.cg` for the data (W = 1 and 8,
  vec 4, 2 warps).
- flags only grow (0 -> 1 -> 2); aggregates and inclusive prefixes live in separate
  buffers written once, so a reader that saw flag 1 reads a valid aggregate even if
  the owner has moved on to flag 2 meanwhile.
The interpreter runs programs one after another in program order, so there every
look-back finds its predecessor's inclusive prefix at once. The constexpr
INCLUSIVE_EVERY = k (launcher argument inclusive_every, tests only) lets only every k-th
chunk publish an inclusive prefix, the others aggregates only, so the composition of
several aggregates over several windows runs on the CPU too.

Checked on the H200 (third session): no launch hung in three runs; outputs, final states
and gradients matched the reference at B = 4, T = 2048, D = 2560 and B = 8, D = 1024,
T = 16384; speed above.

The backward (lookback_bwd_kernel) mirrors the forward: tickets give chunks last first,
a program recomputes its chunk's states from the state the forward saved at its start,
publishes its reverse adjoint map mu_out = ia mu_in + ib (flag 1), looks back over the
chunks after it (look_back with REVERSE) for mu_in, publishes mu_out (flag 2), stores the
gradients and writes its a_param partial (reduced in a fixed order by reduce_dap).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import accounting
from .common import (INTERPRET, acc_dtype, adjoint_scans, affine, channels, check_pow2, empty, fast, first_row,
                     last_row, load_tile, out, softplus, tile_grads_given, tile_states, tl_acc)

L_RANGE = (16, 256)
VECS = (0, 2, 4, 8)
# Unmeasured defaults, from static sm_90 instruction counts (README "Look-back forward").
DEFAULT_L, DEFAULT_VEC, DEFAULT_WARPS, DEFAULT_WINDOW = 16, 4, 2, 8


@triton.jit(do_not_specialize=["T", "NC", "NCB"])
def lookback_fwd_kernel(
    x, gx, ga, ap, pos, h0, flags, agg_a, agg_b, incl, y, hN, S, B, T, D, NC, NCB,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, HAS_H0: tl.constexpr, STORE_HN: tl.constexpr,
    SAVE: tl.constexpr, L: tl.constexpr, KB: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    RNE: tl.constexpr, FAST: tl.constexpr, VEC: tl.constexpr, W: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr,
):
    ND, i_c, i_b, i_d, o_d, m_d, sp = take_ticket(flags, ap, B, D, NC, BD, VEC, False, IS_SCAN, ACC)
    rows = tl.arange(0, L)
    off, m, valid, keep, a, b, xv, sx, sa, mult, u = load_tile(
        x, gx, ga, sp, pos, i_b, i_c * L, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET, ACC, FAST)
    # [L, BD]: the tile's maps composed from its first row, from a zero state
    A, Bs = tl.associative_scan((a, b), 0, affine)
    a_tot = last_row(A, rows, L)
    b_tot = last_row(Bs, rows, L)
    hin, hout = chain_link(flags, agg_a, agg_b, incl, h0, a_tot, b_tot, i_c, i_b, i_d, o_d, m_d, B, D, NC, ND,
                           BD, W, False, HAS_H0, INCLUSIVE_EVERY, ACC)
    h = A * hin[None, :] + Bs
    tl.store(y + off, out(h, y, RNE), mask=m)
    if STORE_HN:
        if i_c == NC - 1:
            tl.store(hN + i_b * D + o_d, hout, mask=m_d)
    if SAVE:
        # S[b, g] = the state entering sub-chunk g (KB steps): the end of sub-chunk g - 1.
        NS: tl.constexpr = L // KB
        ends = tl.sum(tl.where((tl.arange(0, KB) == KB - 1)[None, :, None], tl.reshape(h, [NS, KB, BD]), 0.0),
                      axis=1)
        g = i_c * NS + 1 + tl.arange(0, NS)
        tl.store(S + (i_b * NCB + g[:, None]) * D + o_d[None, :], ends, mask=(g < NCB)[:, None] & m_d[None, :])
        if i_c == 0:
            tl.store(S + i_b * NCB * D + o_d, hin, mask=m_d)


@triton.jit(do_not_specialize=["T", "NC", "NCB"])
def lookback_bwd_kernel(
    x, gx, ga, ap, pos, S, dy, dht, flags, agg_a, agg_b, incl, dx, dgx, dga, dh0, part, B, T, D, NC, NCB,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    L: tl.constexpr, KB: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, RNE: tl.constexpr,
    FAST: tl.constexpr, VEC: tl.constexpr, W: tl.constexpr, FLIP: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr,
):
    """The backward in one pass: the adjoint carry mu runs from the end of the sequence,
    so programs take chunks last first and look back over the chunks after theirs. A
    program recomputes its chunk's states from S (the state entering it, saved by the
    forward every KB steps), forms the chunk's reverse adjoint map mu_out = ia mu_in + ib,
    publishes it (flag 1), looks back for mu_in, publishes mu_out (flag 2) and stores
    every gradient, its a_param partial (row i_c * B + i_b of part) and, for chunk 0,
    dL/dh0 = mu_out."""
    ND, i_c, i_b, i_d, o_d, m_d, sp = take_ticket(flags, ap, B, D, NC, BD, VEC, True, IS_SCAN, ACC)
    rows = tl.arange(0, L)
    off, m, valid, keep, a, b, xv, sx, sa, mult, u = load_tile(
        x, gx, ga, sp, pos, i_b, i_c * L, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET, ACC, FAST)
    dyv = tl.load(dy + off, mask=m, other=0.0).to(ACC)
    hin = tl.load(S + (i_b * NCB + i_c * (L // KB)) * D + o_d, mask=m_d, other=0.0).to(ACC)
    h, hprev = tile_states(a, b, hin, IS_SCAN, ACC)
    ea, eb, ia, ib = adjoint_scans(dyv, a, ACC, FLIP)
    ra = first_row(ia, rows)
    rb = first_row(ib, rows)
    r, r_out = chain_link(flags, agg_a, agg_b, incl, dht, ra, rb, i_c, i_b, i_d, o_d, m_d, B, D, NC, ND,
                          BD, W, True, HAS_DHT, INCLUSIVE_EVERY, ACC)
    _, dsp = tile_grads_given(dyv, dx, dgx, dga, off, m, valid, keep, a, b, xv, sx, sa, mult, u, h, hprev, r,
                              ea, eb, ia, ib, sp, rows, IS_SCAN, ACC, RNE, FAST)
    if STORE_DH0:
        if i_c == 0:
            tl.store(dh0 + i_b * D + o_d, r_out, mask=m_d)
    if not IS_SCAN:
        tl.store(part + (i_c * B + i_b) * D + o_d, dsp, mask=m_d)


@triton.jit
def take_ticket(flags, ap, B, D, NC, BD: tl.constexpr, VEC: tl.constexpr, REVERSE: tl.constexpr,
                IS_SCAN: tl.constexpr, ACC: tl.constexpr):
    """The program's place from its ticket (an atomic counter after the NC * ND * B
    flags; see the module docstring): (ND, chunk, batch row, channel block, channels,
    their mask, softplus(a_param) or zeros). Chunks are taken first to last, or last
    first when REVERSE, the chunk slowest-varying."""
    ND = tl.cdiv(D, BD)
    ticket = tl.atomic_add(flags + NC * ND * B, 1, sem="relaxed")
    i_c = ticket // (B * ND)
    if REVERSE:
        i_c = NC - 1 - i_c
    i_b = ((ticket // ND) % B).to(tl.int64)
    i_d = ticket % ND
    o_d = channels(i_d, BD, VEC)
    m_d = o_d < D
    if IS_SCAN:
        sp = tl.zeros([BD], ACC)
    else:
        sp = softplus(tl.load(ap + o_d, mask=m_d, other=0.0).to(ACC))
    return ND, i_c, i_b, i_d, o_d, m_d, sp


@triton.jit
def publish(pa, pb, my, va, vb, m_d, flag, value: tl.constexpr, PAIR: tl.constexpr):
    """Stores va (and vb when PAIR) at my, then releases flag = value: the barrier orders
    every thread's stores before the one release (see the module docstring)."""
    tl.store(pa + my, va, mask=m_d)
    if PAIR:
        tl.store(pb + my, vb, mask=m_d)
    tl.debug_barrier()
    tl.atomic_xchg(flag, value, sem="release")


@triton.jit
def chain_link(flags, agg_a, agg_b, incl, init, ta, tb, i_c, i_b, i_d, o_d, m_d, B, D, NC, ND,
               BD: tl.constexpr, W: tl.constexpr, REVERSE: tl.constexpr, HAS_INIT: tl.constexpr,
               INCLUSIVE_EVERY: tl.constexpr, ACC: tl.constexpr):
    """One chunk's part in the chain, given its own map v -> ta v + tb [BD]: publishes
    the map (flag 1; the first chunk of the chain has nothing to publish), looks back
    for the value v entering the chunk (from `init` [B, D] before the first chunk, zero
    without HAS_INIT), publishes ta v + tb (flag 2; with INCLUSIVE_EVERY = k, a test knob,
    only every k-th chunk of the chain) and returns (v, ta v + tb). REVERSE: the chain
    runs from the last chunk (see look_back)."""
    my_flag = flags + (i_c * ND + i_d) * B + i_b
    my = (i_c * B + i_b) * D + o_d
    if REVERSE:
        place = NC - 1 - i_c
    else:
        place = i_c
    if place > 0:
        publish(agg_a, agg_b, my, ta, tb, m_d, my_flag, 1, True)
    if HAS_INIT:
        s = tl.load(init + i_b * D + o_d, mask=m_d, other=0.0).to(ACC)
    else:
        s = tl.zeros([BD], ACC)
    ca, cb = look_back(flags, agg_a, agg_b, incl, i_c, i_b, i_d, o_d, m_d, B, D, NC, ND, BD, W, REVERSE, ACC)
    v = ca * s + cb
    v_out = ta * v + tb
    if place % INCLUSIVE_EVERY == 0:
        publish(incl, incl, my, v_out, v_out, m_d, my_flag, 2, False)
    return v, v_out


@triton.jit
def look_back(flags, agg_a, agg_b, incl, i_c, i_b, i_d, o_d, m_d, B, D, NC, ND, BD: tl.constexpr,
              W: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr):
    """[BD] (ca, cb): the composed map of the chunks between chunk i_c and the nearest
    predecessor holding an inclusive prefix, that prefix included (as a constant map),
    so the value entering chunk i_c is ca * s + cb with s the value before the first
    chunk (the initial state; the final state's gradient when REVERSE). Predecessors are
    the chunks before i_c in time, or after it when REVERSE (the backward's carry runs
    from the end). Waits until every flag of a window of W predecessors is set."""
    # [BD] the map of the predecessors gathered so far (nearest first), applied to the
    # value at the far side of the gathered ones
    ca = tl.full([BD], 1.0, ACC)
    cb = tl.zeros([BD], ACC)
    wv = tl.arange(0, W)
    if REVERSE:
        j = i_c + 1
        more = j <= NC - 1
    else:
        j = i_c - 1
        more = j >= 0
    while more:
        # [W] the window of predecessors, farthest first; beyond the sequence identity
        # maps, ready
        if REVERSE:
            c = j + (W - 1) - wv
            m_c = c <= NC - 1
        else:
            c = j - (W - 1) + wv
            m_c = c >= 0
        f_ptr = flags + (c * ND + i_d) * B + i_b
        f = tl.where(m_c, tl.atomic_add(f_ptr, 0, mask=m_c, sem="acquire"), 1)
        while tl.min(f, axis=0) == 0:
            f = tl.where(m_c, tl.atomic_add(f_ptr, 0, mask=m_c, sem="acquire"), 1)
        # [W, BD] an inclusive prefix is the constant map z -> 0 z + s_c: composed after
        # farther maps it discards them exactly, so the window's composition is the map
        # from the nearest inclusive prefix (if any) on
        o = (c[:, None] * B + i_b) * D + o_d[None, :]
        mm = m_c[:, None] & m_d[None, :]
        is_incl = (f == 2)[:, None]
        wa = tl.load(agg_a + o, mask=mm & ~is_incl, other=1.0, cache_modifier=".cg")
        wa = tl.where(is_incl, 0.0, wa)
        wb = tl.load(tl.where(is_incl, incl + o, agg_b + o), mask=mm, other=0.0, cache_modifier=".cg")
        WA, WB = tl.associative_scan((wa, wb), 0, affine)
        cb = ca * last_row(WB, wv, W) + cb
        ca = ca * last_row(WA, wv, W)
        done = tl.max(f, axis=0) == 2
        if REVERSE:
            j = j + W
            more = (j <= NC - 1) & ~done
        else:
            j = j - W
            more = (j >= 0) & ~done
    return ca, cb


def lookback_config(D, chunk_size=None, block_d=None, num_warps=None, vec=None, window=None, prefix="") -> dict:
    """A look-back kernel's launch configuration from the chunk backend's options:
    chunk_size L (power of two in [16, 256]), vec (0: Triton's tile layout, block_d a
    power of two in [8, 1024], default 64 and 4 warps; 2, 4, 8: channels per thread with
    the chunk's time axis inside each thread, block_d = 32 * vec * k for a power of two
    k dividing num_warps, default 32 * num_warps * vec: k warps side by side along the
    channels, the other num_warps / k warps along the chunk's time axis, so a longer
    chunk costs no more registers per thread), window (predecessors examined per
    look-back step, power of two in [1, 64]). Defaults: L 16, vec 4, 2 warps (block_d
    256), window 8. prefix names the options in errors ("bwd_" for the backward's)."""
    L = check_pow2(prefix + "chunk_size", DEFAULT_L if chunk_size is None else chunk_size, *L_RANGE)
    v = DEFAULT_VEC if vec is None else vec
    if v not in VECS:
        raise ValueError(f"expected {prefix}vec in {list(VECS)} (channels per thread, the chunk's time axis inside "
                         f"each thread; 0: Triton's tile layout), got {vec!r}")
    if v:
        nw = DEFAULT_WARPS if num_warps is None else check_pow2(prefix + "num_warps", num_warps, 1, 16)
        bd = 32 * nw * v if block_d is None else block_d
        k = bd // (32 * v) if isinstance(bd, int) and bd % (32 * v) == 0 else 0
        if k < 1 or k & (k - 1) or nw % k:
            raise ValueError(f"expected {prefix}block_d to be None or 32 * vec * k = {32 * v} * k with k a power "
                             f"of two dividing {prefix}num_warps = {nw} when vec > 0, got {block_d!r}")
    else:
        nw = 4 if num_warps is None else check_pow2(prefix + "num_warps", num_warps, 1, 16)
        bd = 64 if block_d is None else check_pow2(prefix + "block_d", block_d, 8, 1024)
        bd = min(bd, max(8, triton.next_power_of_2(D)))
    w = check_pow2("window", DEFAULT_WINDOW if window is None else window, 1, 64)
    return {"L": L, "BD": bd, "num_warps": nw, "VEC": v, "W": w}


def workspace_flags(n: int, device) -> torch.Tensor:
    """The zeroed int32 flags and ticket counter of one launch (a function so tests can
    inspect them)."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def _workspaces(kind: str, NC: int, B: int, D: int, BD: int, acc, device):
    """One launch's zeroed flags (one per program, then the ticket counter) and its
    aggregate and inclusive-prefix buffers [NC, B, D]; the flags' memset is counted as
    launch chunk_<kind>_lookback_flags."""
    flags = workspace_flags(NC * triton.cdiv(D, BD) * B + 1, device)
    accounting.record(f"chunk_{kind}_lookback_flags", 0, accounting.nbytes(flags))
    return flags, empty((NC, B, D), acc, device), empty((NC, B, D), acc, device), empty((NC, B, D), acc, device)


def lookback_forward(x, gx, ga, a_param, pos, h0, output_final_state, save, is_scan, cfg, inclusive_every=1):
    """Launcher. Scan mode: x = b, ga = a. cfg: the chunk backend's, with "lookback"
    (lookback_config), "K" (sub-chunk of the saved states) and "FAST". Returns (y, final state or None,
    S [B, ceil(T / K), D] or None). inclusive_every > 1 is a test knob (see the module
    docstring); it never changes the result."""
    B, T, D = x.shape
    lb = cfg["lookback"]
    L, KB, BD = lb["L"], cfg["K"], lb["BD"]
    NC, NCB = triton.cdiv(T, L), triton.cdiv(T, KB)
    acc = acc_dtype(x.dtype)
    flags, agg_a, agg_b, incl = _workspaces("fwd", NC, B, D, BD, acc, x.device)
    y = empty((B, T, D), x.dtype, x.device)
    hN = empty((B, D), acc, x.device) if output_final_state else None
    S = empty((B, NCB, D), acc, x.device) if save else None
    lookback_fwd_kernel[(flags.numel() - 1,)](
        x, gx, ga, a_param if a_param is not None else x, pos if pos is not None else x,
        h0 if h0 is not None else x, flags, agg_a, agg_b, incl, y, hN if hN is not None else y,
        S if S is not None else y, B, T, D, NC, NCB,
        IS_SCAN=is_scan, HAS_RESET=pos is not None, HAS_H0=h0 is not None, STORE_HN=output_final_state,
        SAVE=save, L=L, KB=KB, BD=BD, ACC=tl_acc(x.dtype), RNE=INTERPRET, FAST=fast(cfg, x),
        VEC=lb["VEC"], W=lb["W"], INCLUSIVE_EVERY=inclusive_every, num_warps=lb["num_warps"],
    )
    n = x.numel() * x.element_size()
    read = (2 if is_scan else 3) * n + accounting.nbytes(pos, h0, None if is_scan else a_param)
    # Workspaces: every chunk's aggregate and inclusive prefix written, at least one
    # inclusive prefix read per chunk; the flags' memset and atomics are not counted.
    ws = NC * B * D * torch.finfo(acc).bits // 8
    accounting.record("chunk_fwd_lookback", read + ws, accounting.nbytes(y, hN, S) + 3 * ws)
    return y, hN, S


def lookback_backward(x, gx, ga, a_param, pos, S, dy, dht, need_dh0, is_scan, cfg, inclusive_every=1):
    """Launcher of the one-pass backward (lookback_bwd_kernel). cfg: the chunk backend's,
    with "lookback_bwd" (lookback_config of the bwd_ options; its L is the saved states'
    spacing cfg["K"] or a multiple of it) and "FAST". Returns (dx, dgx, dga, dh0, part)
    as chunk_backward does; part is [NC * B, D] (row i_c * B + i_b)."""
    B, T, D = x.shape
    lb = cfg["lookback_bwd"]
    L, KB, BD = lb["L"], cfg["K"], lb["BD"]
    NC, NCB = triton.cdiv(T, L), triton.cdiv(T, KB)
    acc = acc_dtype(x.dtype)
    flags, agg_a, agg_b, incl = _workspaces("bwd", NC, B, D, BD, acc, x.device)
    dx = empty((B, T, D), x.dtype, x.device)
    dga = empty((B, T, D), ga.dtype, x.device)
    dgx = None if is_scan else empty((B, T, D), gx.dtype, x.device)
    part = None if is_scan else empty((NC * B, D), acc, x.device)
    dh0 = empty((B, D), acc, x.device) if need_dh0 else None
    lookback_bwd_kernel[(flags.numel() - 1,)](
        x, gx, ga, a_param if a_param is not None else x, pos if pos is not None else x, S, dy,
        dht if dht is not None else S, flags, agg_a, agg_b, incl, dx, dgx if dgx is not None else dx, dga,
        dh0 if dh0 is not None else S, part if part is not None else S, B, T, D, NC, NCB,
        IS_SCAN=is_scan, HAS_RESET=pos is not None, HAS_DHT=dht is not None, STORE_DH0=need_dh0,
        L=L, KB=KB, BD=BD, ACC=tl_acc(x.dtype), RNE=INTERPRET, FAST=fast(cfg, x), VEC=lb["VEC"], W=lb["W"],
        FLIP=lb["VEC"] > 0, INCLUSIVE_EVERY=inclusive_every, num_warps=lb["num_warps"],
    )
    n = x.numel() * x.element_size()
    read = (3 if is_scan else 4) * n + accounting.nbytes(pos, dht, None if is_scan else a_param)
    ws = NC * B * D * torch.finfo(acc).bits // 8
    accounting.record("chunk_bwd_lookback", read + ws + NC * B * D * torch.finfo(acc).bits // 8,
                      accounting.nbytes(dx, dgx, dga, part, dh0) + 3 * ws)
    return dx, dgx, dga, dh0, part
