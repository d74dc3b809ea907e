"""Serial, state-stationary RG-LRU and affine scan: one program owns CH channels of one
sequence (block_d; a tile of BD = next_pow2(CH) lanes) and walks time in tiles, the FP32
state in registers; the backward walks the tiles in reverse from the saved states
(common.py's adjoint). The a_param gradient is a per-program partial [B, D] reduced in a
fixed order.

Split kernels (time_warps W > 1, the default): tiles of W * TT steps (TT = chunk_size),
warp w holding TT consecutive steps in its threads' registers (one thread per channel
column leaves too few threads on serial chains to cover memory latency). Each warp scans
from a zero state, one small scan composes the W segment maps across warps, and the state
entering every segment is saved, so the backward's warps recompute their states alone.
Tiles are addressed in memory order [W, TT, BD] (Triton's coalescing picks that layout)
and relabelled [TT, W, BD] (mem_order) for the scans along axis 0. Tile kernels (W = 1;
the default for an RG-LRU forward without gradient): one associative scan per TT steps.
Options: chunk_size (TT), time_warps, block_d, num_stages (1: register prefetch).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..accounting import account
from ..checks import check_chunk_size, state_dtype
from ..triton_utils import (INTERPRET, cdiv, check_pow2, empty, empty_like, launcher, multiprocessors,
                           next_pow2, out, replayed, smem_limit, tl_acc)
from .common import (affine, coeffs, excl_scan, load_inputs, mem_order, pass_inputs, program_start, row_of, tile_grads,
                     tile_offsets, tile_states)


@triton.jit
def axes(TT: tl.constexpr, W: tl.constexpr):
    """(the scan's time axis: [TT, 1] split, [TT] tile; warp [W, 1]; the steps a tile is
    addressed by: [1, TT] split, [TT] tile)."""
    if W > 1:
        ii = tl.arange(0, TT)[:, None]
        im = tl.arange(0, TT)[None, :]
    else:
        ii = tl.arange(0, TT)
        im = ii
    return ii, tl.arange(0, W)[:, None], im


@triton.jit
def tile_at(i_b, t0, T, D, o_d, m_d, im, seg, TT: tl.constexpr, W: tl.constexpr, EVEN: tl.constexpr):
    """The tile of steps from t0: (steps, base element, offsets from it, mask). Split: warp
    row w holds segment seg[w], int32 offsets in memory order [W, TT, BD] (Triton orders
    equal-contiguity dims by position, so axis 1 stays in each thread's registers); EVEN:
    one uniform predicate (for whole tiles outside [0, T) that the prefetch reaches)."""
    if W == 1:
        rel, m = tile_offsets(i_b, t0, T, D, o_d, m_d, im)
        return t0 + im, 0, rel, m
    else:
        rt = seg * TT + im
        t = t0 + rt
        base = (i_b * T + t0) * D
        rel = (rt * D)[:, :, None] + o_d[None, None, :]
        m = tl.full(rel.shape, 1, tl.int1) & ((t0 >= 0) & (t0 < T)) if EVEN else \
            ((t >= 0) & (t < T))[:, :, None] & m_d[None, None, :]
        return t, base, rel, m


@triton.jit
def tile_load(x, gx, ga, pos, i_b, t0, T, D, o_d, m_d, im, seg, TT: tl.constexpr, W: tl.constexpr,
              IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, EVEN: tl.constexpr):
    """The tile's inputs as stored and its positions (common.load_inputs); split: inputs
    in scan order [TT, W, BD], positions [TT, W]."""
    t, base, rel, m = tile_at(i_b, t0, T, D, o_d, m_d, im, seg, TT, W, EVEN)
    r0, r1, r2, p = load_inputs(x + base, gx + base, ga + base, pos + i_b * T, rel, m, t, T, IS_SCAN, HAS_RESET)
    if W > 1:
        r0, r1, r2, p = mem_order(r0, True), mem_order(r1, True), mem_order(r2, True), tl.trans(p)
    return r0, r1, r2, p


@triton.jit
def row_masks(t, p, T, W: tl.constexpr):
    """(valid, keep) of a tile (common.coeffs), shaped to broadcast against it."""
    if W == 1:
        return (t < T)[:, None], (p != 0)[:, None]
    else:
        return tl.trans(t < T)[:, :, None], (p != 0)[:, :, None]


@triton.jit
def split_states(a, b, hin, ii, wcol, TT: tl.constexpr, W: tl.constexpr, ACC: tl.constexpr):
    """(h, the state leaving the tile, the state entering each warp's segment [W, BD]) of a
    [TT, W, BD] tile entered with state hin [BD]."""
    A, Bs = tl.associative_scan((a, b), 0, affine)
    last = ii[:, :, None]
    sa = row_of(A, last, TT - 1)
    sb = row_of(Bs, last, TT - 1)
    # [W, BD]: the composition of the segments before w (exclusive) and up to w
    xa, xb, ia, ib = excl_scan(sa, sb, ACC)
    hw = xa * hin[None, :] + xb
    h = A * hw[None, :, :] + Bs
    hout = row_of(ia * hin[None, :] + ib, wcol, W - 1)
    return h, hout, hw


@triton.jit
def load_entry(hs, i_b, i_t, NT, D, o_d, m_d, seg, W: tl.constexpr, PREV: tl.constexpr):
    """The saved state entering tile i_t (PREV: tile i_t - 1, zeros or a repeat before the
    first): split, per warp row its segment's [W, BD]; else [BD]."""
    if W > 1:
        if PREV:
            i_t = tl.maximum(i_t - 1, 0)
        return tl.load(hs + ((i_b * NT + i_t) * W + seg) * D + o_d[None, :], mask=m_d[None, :], other=0.0)
    elif PREV:
        return tl.load(hs + (i_b * NT + i_t - 1) * D + o_d, mask=m_d & (i_t > 0), other=0.0)
    else:
        return tl.load(hs + (i_b * NT + i_t) * D + o_d, mask=m_d, other=0.0)


@launcher
@triton.jit(do_not_specialize=["T"])
def serial_fwd_kernel(x, gx, ga, ap, pos, h0, y, ht, hs, T, D, IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr,
                      HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE: tl.constexpr, TT: tl.constexpr,
                      W: tl.constexpr, BD: tl.constexpr, CH: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
                      EVEN: tl.constexpr, ACC: tl.constexpr, RNE: tl.constexpr, VEC: tl.constexpr):
    i_b, o_d, m_d, sp, h = program_start(ap, h0, D, BD, CH, VEC, IS_SCAN, HAS_H0, ACC)
    ii, wcol, im = axes(TT, W)
    BT: tl.constexpr = TT * W
    NT = tl.cdiv(T, BT)
    if PREFETCH:
        # The next tile's loads are issued before this tile's scan, so a program keeps
        # two tiles in flight without relying on the compiler's loop pipelining.
        r0, r1, r2, p = tile_load(x, gx, ga, pos, i_b, 0, T, D, o_d, m_d, im, wcol, TT, W, IS_SCAN, HAS_RESET, EVEN)
    for i_t in tl.range(0, NT, num_stages=STAGES):
        t0 = i_t * BT
        if SAVE and W == 1:
            tl.store(hs + (i_b * NT + i_t) * D + o_d, h, mask=m_d)
        t, base, rel, m = tile_at(i_b, t0, T, D, o_d, m_d, im, wcol, TT, W, EVEN)
        if PREFETCH:
            n0, n1, n2, n_p = tile_load(x, gx, ga, pos, i_b, t0 + BT, T, D, o_d, m_d, im, wcol, TT, W, IS_SCAN,
                                        HAS_RESET, EVEN)
        else:
            r0, r1, r2, p = tile_load(x, gx, ga, pos, i_b, t0, T, D, o_d, m_d, im, wcol, TT, W, IS_SCAN, HAS_RESET,
                                      EVEN)
        valid, keep = row_masks(t, p, T, W)
        a, b, xv, sx, sa, mult, u = coeffs(r0, r1, r2, valid, keep, sp, IS_SCAN, ACC)
        if W == 1:
            A, Bs = tl.associative_scan((a, b), 0, affine)
            hh = A * h[None, :] + Bs
        else:
            hh, h, hw = split_states(a, b, h, ii, wcol, TT, W, ACC)
            if SAVE:
                tl.store(hs + ((i_b * NT + i_t) * W + wcol) * D + o_d[None, :], hw, mask=m_d[None, :])
        tl.store(y + base + rel, out(mem_order(hh, W > 1), y, RNE), mask=m)
        if W == 1:
            h = row_of(hh, im[:, None], BT - 1)
        if PREFETCH:
            r0, r1, r2, p = n0, n1, n2, n_p
    if STORE_HT:
        tl.store(ht + i_b * D + o_d, h, mask=m_d)


@launcher
@triton.jit(do_not_specialize=["T"])
def serial_bwd_kernel(x, gx, ga, ap, pos, hs, dy, dht, dx, dgx, dga, dh0, dsp_part, T, D, IS_SCAN: tl.constexpr,
                      HAS_RESET: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, TT: tl.constexpr,
                      W: tl.constexpr, BD: tl.constexpr, CH: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
                      EVEN: tl.constexpr, ACC: tl.constexpr, RNE: tl.constexpr, VEC: tl.constexpr):
    i_b, o_d, m_d, sp, r = program_start(ap, dht, D, BD, CH, VEC, IS_SCAN, HAS_DHT, ACC)
    ii, wcol, im = axes(TT, W)
    # Split: warp w holds segment W - 1 - w, so the adjoint's composition from the
    # tile's end runs forward over the warps (Triton's reverse scan across warps costs
    # lane shuffles).
    seg = W - 1 - wcol
    if W == 1:
        dsp = tl.zeros([BD], ACC)
    else:
        dsp = tl.zeros([W, BD], ACC)
    BT: tl.constexpr = TT * W
    NT = tl.cdiv(T, BT)
    if PREFETCH:
        t_last = (NT - 1) * BT
        t_l, base_l, rel, m = tile_at(i_b, t_last, T, D, o_d, m_d, im, seg, TT, W, EVEN)
        r0, r1, r2, p = tile_load(x, gx, ga, pos, i_b, t_last, T, D, o_d, m_d, im, seg, TT, W, IS_SCAN, HAS_RESET, EVEN)
        dyr = mem_order(tl.load(dy + base_l + rel, mask=m, other=0.0), W > 1)
        if W == 1:
            hin = tl.load(hs + (i_b * NT + NT - 1) * D + o_d, mask=m_d, other=0.0)
        else:
            hin = load_entry(hs, i_b, NT - 1, NT, D, o_d, m_d, seg, W, False)
    for j in tl.range(0, NT, num_stages=STAGES):
        i_t = NT - 1 - j
        t0 = i_t * BT
        t, base, rel, m = tile_at(i_b, t0, T, D, o_d, m_d, im, seg, TT, W, EVEN)
        if PREFETCH:
            t_n, base_n, reln, mn = tile_at(i_b, t0 - BT, T, D, o_d, m_d, im, seg, TT, W, EVEN)
            n0, n1, n2, n_p = tile_load(x, gx, ga, pos, i_b, t0 - BT, T, D, o_d, m_d, im, seg, TT, W, IS_SCAN,
                                        HAS_RESET, EVEN)
            n_dy = mem_order(tl.load(dy + base_n + reln, mask=mn, other=0.0), W > 1)
            n_hin = load_entry(hs, i_b, i_t, NT, D, o_d, m_d, seg, W, True)
        else:
            r0, r1, r2, p = tile_load(x, gx, ga, pos, i_b, t0, T, D, o_d, m_d, im, seg, TT, W, IS_SCAN, HAS_RESET, EVEN)
            dyr = mem_order(tl.load(dy + base + rel, mask=m, other=0.0), W > 1)
            hin = load_entry(hs, i_b, i_t, NT, D, o_d, m_d, seg, W, False)
        valid, keep = row_masks(t, p, T, W)
        a, b, xv, sx, sa, mult, u = coeffs(r0, r1, r2, valid, keep, sp, IS_SCAN, ACC)
        h = tile_states(a, b, hin, IS_SCAN, ACC)
        r, dsp_t = tile_grads(dyr, dx + base, dgx + base, dga + base, rel, m, valid, keep, a, b, xv, sx, sa, mult, u,
                              h, r, sp, ii, IS_SCAN, ACC, RNE, seg, W)
        if not IS_SCAN:
            dsp += dsp_t
        if PREFETCH:
            r0, r1, r2, p, dyr, hin = n0, n1, n2, n_p, n_dy, n_hin
    if W > 1:
        dsp = tl.sum(dsp, axis=0)
    if STORE_DH0:
        tl.store(dh0 + i_b * D + o_d, r, mask=m_d)
    if not IS_SCAN:
        tl.store(dsp_part + i_b * D + o_d, dsp, mask=m_d)


# Defaults: the fastest exact configurations in the H200 tune records (the tune stage
# re-selects per GPU); the tile kernels take 4 warps and register prefetch.
SPLIT_DEFAULT = {"rglru": {"time_warps": 4, "num_stages": 3}, "scan": {"time_warps": 8, "num_stages": 4}}
# Tile widths of a split program (2, 4 or 8 channels per lane): 128 and 256 halve and quarter
# the programs. Its channels (block_d) are a multiple of 16 up to the tile's width, so that
# B x D / block_d programs can match the multiprocessors.
SPLIT_BLOCKS = (64, 128, 256)
# The scan where B x D / 64 programs exceed the multiprocessors, keyed by `grad`: 128-channel
# programs leave no second, partial wave of 64-channel ones (faster forward and forward+backward
# at B4 D2560 in the tune and ops-track records); where 64-channel blocks fill one wave they are
# slower; with gradient 3 stages.
SCAN_WIDE = {False: {"time_warps": 4, "block_d": 128, "num_stages": 4},
             True: {"time_warps": 4, "block_d": 128, "num_stages": 3}}
OPTIONS = ("chunk_size", "time_warps", "block_d", "num_stages")


def config(B, T, D, is_scan, sms=None, /, chunk_size=None, time_warps=None, block_d=None, num_stages=None,
           grad=True, **unknown):
    """Launch configuration from the options; `sms`: the device's multiprocessors (None
    off the GPU), which picks SCAN_WIDE where no option but chunk_size is given."""
    if unknown:
        raise ValueError(f"expected serial options among {list(OPTIONS)}, got {sorted(unknown)}")
    if is_scan and sms and (time_warps, block_d, num_stages) == (None,) * 3 and B * cdiv(D, 64) > sms:
        time_warps, block_d, num_stages = SCAN_WIDE[bool(grad)].values()
    stages_set = num_stages is not None
    tt = None if chunk_size is None else check_chunk_size(chunk_size)
    if time_warps is None:
        tile = block_d is not None or (not is_scan and not grad)
        default = SPLIT_DEFAULT["scan" if is_scan else "rglru"]
        time_warps = 1 if tile else default["time_warps"]
        if not tile and num_stages is None:
            num_stages = default["num_stages"]
    tw = check_pow2("time_warps", time_warps, 1, 16)
    ns = 1 if num_stages is None else num_stages
    if not isinstance(ns, int) or isinstance(ns, bool) or not 1 <= ns <= 4:
        raise ValueError(f"expected num_stages to be an integer in [1, 4], got {num_stages!r}")
    if tw > 1:
        ch = 64 if block_d is None else block_d
        if isinstance(ch, bool) or not isinstance(ch, int) or ch % 16 or not SPLIT_BLOCKS[0] <= ch <= SPLIT_BLOCKS[-1]:
            raise ValueError(f"expected block_d a multiple of 16 in [{SPLIT_BLOCKS[0]}, {SPLIT_BLOCKS[-1]}] with "
                             f"time_warps > 1 (channels of a split kernel's program, in a tile of {list(SPLIT_BLOCKS)} "
                             f"lanes: 2, 4 or 8 per lane), got block_d={block_d!r} with time_warps={tw}")
        bd = next_pow2(ch)
        # TT >= 8: the saved states are at most 1/8 of an FP32 activation
        tt = tt or 8
    else:
        tt = tt or (128 if is_scan else 64)
        # default: the widest block in [lo, 64] that still gives 528 programs (4 per H200
        # multiprocessor), else lo
        lo, bd = (32 if is_scan else 16), 64
        while bd > lo and B * cdiv(D, bd) < 528:
            bd //= 2
        bd = max(lo, min(bd, next_pow2(D))) if block_d is None else check_pow2("block_d", block_d, 8, 1024)
        ch = bd
    return {"backend": "serial", "TT": tt, "TW": tw, "BD": bd, "CH": ch, "STAGES": ns, "STAGES_SET": stages_set}


def _fit_stages(cfg: dict, elsize: int, n_tiles: int, has_pos: bool, limit) -> dict:
    """The split kernels' pipelined loads hold num_stages - 1 tiles of each input in shared
    memory: a default num_stages that does not fit `limit` bytes is lowered, an explicit one
    is an error."""
    if cfg["TW"] == 1 or cfg["STAGES"] == 1 or limit is None:
        return cfg
    BT = cfg["TT"] * cfg["TW"]
    tile = BT * cfg["BD"] * elsize * n_tiles + (BT * 8 if has_pos else 0)
    scratch = 8 * cfg["TW"] * cfg["BD"] * 4 + 4096       # the cross-warp scans and layout changes
    stages = cfg["STAGES"]
    while stages > 1 and (stages - 1) * tile + scratch > limit:
        if cfg["STAGES_SET"]:
            raise ValueError(f"expected num_stages with (num_stages - 1) x {tile} bytes of tiles within the device's "
                             f"{limit} bytes of shared memory (time_warps {cfg['TW']}, chunk_size {cfg['TT']}, "
                             f"{elsize}-byte elements), got {cfg['STAGES']}; lower num_stages or chunk_size")
        stages -= 1
    return cfg if stages == cfg["STAGES"] else {**cfg, "STAGES": stages}


def _launch(kernel, x, pos, is_scan, cfg, n_tiles, args, **flags):
    tensors = args[:-2]                   # args: (tensors..., T, D); the key fixes T, D, each dtype and device
    key = (kernel, id(cfg), *x.shape, *[(t.dtype, t.device) for t in tensors], pos is not None, is_scan, n_tiles,
           *flags.items())
    plan = _PLANS.get(key)
    if plan is None or plan[0] is not cfg:
        if len(_PLANS) >= 4096:
            _PLANS.clear()
        plan = _PLANS[key] = [cfg, *_plan(x, pos, is_scan, cfg, n_tiles, flags), {}]
    replayed(plan[3], None, kernel, plan[1], args, len(tensors), **plan[2])


def _plan(x, pos, is_scan, cfg, n_tiles, flags) -> tuple[tuple, dict]:
    """(grid, keyword arguments) of a launch, kept by _launch per shape, dtype, device and
    configuration (the launchers run on the host's critical path)."""
    B, T, D = x.shape
    cfg = _fit_stages(cfg, x.element_size(), n_tiles, pos is not None, smem_limit(x.device))
    BT, W, BD, CH = cfg["TT"] * cfg["TW"], cfg["TW"], cfg["BD"], cfg["CH"]
    if W > 1 and (BT + 1) * D >= 2 ** 31:
        raise ValueError(f"expected (time_warps * chunk_size + 1) * D < 2**31 for the split kernels' int32 tile "
                         f"offsets, got D = {D} with a tile of {BT} steps")
    kw = dict(IS_SCAN=is_scan, HAS_RESET=pos is not None, BD=BD, CH=CH, STAGES=cfg["STAGES"],
              PREFETCH=cfg["STAGES"] == 1, ACC=tl_acc(x.dtype), RNE=INTERPRET, VEC=BD // 32 if W > 1 else 0,
              num_warps=W if W > 1 else 4, **flags, TT=cfg["TT"], W=W,
              EVEN=W > 1 and T % BT == 0 and D % BD == 0 and CH == BD)
    return (cdiv(D, CH), B), kw


# _launch's plans by kernel, configuration (kept in the value: its id names it only while
# it lives), shape, each tensor's dtype and device, and flags: grid, keywords, replayed launches
_PLANS: dict = {}


def forward(x, gx, ga, a_param, pos, h0, output_final_state, save, is_scan, cfg):
    """Scan mode: x = b, ga = a (gx, a_param unused). Returns (y, ht, hs)."""
    B, T, D = x.shape
    acc = state_dtype(x.dtype)
    y = empty_like(x)
    ht = empty((B, D), acc, x.device) if output_final_state else None
    hs = empty(saved_shape(cfg, B, T, D), acc, x.device) if save else None
    _launch(serial_fwd_kernel, x, pos, is_scan, cfg, 2 if is_scan else 3,
            (x, gx, ga, a_param if a_param is not None else x, pos if pos is not None else x,
             h0 if h0 is not None else x, y, ht if ht is not None else y, hs if hs is not None else y, T, D),
            HAS_H0=h0 is not None, STORE_HT=ht is not None, SAVE=save)
    account("scan_serial_fwd" if is_scan else "rglru_serial_fwd", (*pass_inputs(is_scan, x, gx, ga, a_param, pos), h0),
            (y, ht, hs))
    return y, ht, hs


def backward(x, gx, ga, a_param, pos, hs, dy, dht, need_dh0, is_scan, cfg):
    """Returns (dx, dgx, dga, dh0, dsp_part); scan mode: dx = db, dga = da."""
    B, T, D = x.shape
    acc = state_dtype(x.dtype)
    dx = empty_like(x)
    dga = empty((B, T, D), ga.dtype, x.device)
    dgx = None if is_scan else empty((B, T, D), gx.dtype, x.device)
    dh0 = empty((B, D), acc, x.device) if need_dh0 else None
    part = None if is_scan else empty((B, D), acc, x.device)
    _launch(serial_bwd_kernel, x, pos, is_scan, cfg, 3 if is_scan else 4,
            (x, gx, ga, a_param if a_param is not None else x, pos if pos is not None else x, hs, dy,
             dht if dht is not None else hs, dx, dgx if dgx is not None else dx, dga,
             dh0 if dh0 is not None else hs, part if part is not None else hs, T, D),
            HAS_DHT=dht is not None, STORE_DH0=need_dh0)
    account("scan_serial_bwd" if is_scan else "rglru_serial_bwd",
            (*pass_inputs(is_scan, x, gx, ga, a_param, pos), hs, dy, dht), (dx, dgx, dga, dh0, part))
    return dx, dgx, dga, dh0, part


def saved_shape(cfg: dict, B: int, T: int, D: int) -> tuple:
    """The states the forward keeps: entering every tile (split: warp segment) [B, NT, D]."""
    return (B, cdiv(T, cfg["TT"] * cfg["TW"]) * cfg["TW"], D)
