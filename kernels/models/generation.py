"""Generation engine for HawkLM (either mixer): static caches, prefill, a one-token step
captured in a CUDA graph per batch size, sampling, stop tokens and a streaming iterator.

    engine = Engine(model)                                      # graphs on CUDA
    out = engine.generate(prompts, 128, temperature=0.8, top_k=50, stop_tokens=[1])
    for tokens in engine.stream(prompts, 128): ...              # tokens [B] per step

Each batch size has one `_Slot` of static decoding state. A step has no host
synchronisation; on CUDA it is captured once per (B, greedy or sampled, top_k, generator)
and replayed. A graph keeps the parameter storage it captured: build a new engine after
replacing parameters (SAMU's mode tables are refreshed in place at every `start`).

Prompts are left-padded to a common length P; as in recurrentgemma's sampler, positions are
t - (P - length) clipped at -1, so pads never reach a real token. An empty prompt is
[bos_id]. Prefill runs the first P - 1 columns in chunks of `prefill_chunk`; the last prompt
token is the first step's input.

Step kernels (`kernels=`), all with HawkLM.step's roundings: "model" (its own layers); "fused"
(library matmuls plus decode's row kernels); "gemm" (decode's weight-streaming linears, for
B <= 64, "fused" above); "auto" (CUDA: "gemm" up to AUTO_GEMM_MAX_ROWS rows for bf16/fp16,
else "fused"; "model" elsewhere).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from .. import ops
from . import decode as dk
from ..layers import SAMU
from ..ops.checks import is_integer_dtype, shape_str
from ..ops.geglu import geglu, gelu_mul
from .hawk import HawkCache, HawkLM

KERNELS = ("auto", "model", "fused", "gemm")
# "auto" uses the weight-streaming linears up to this batch (H200, preset 1.3b: 1.39 ms
# per step against 1.68 for "fused" at B = 16; at B = 32 and 64 "fused" was faster).
AUTO_GEMM_MAX_ROWS = 16
# The weight-streaming linears of a step, the keys of `linear_configs`.
LINEAR_ROLES = ("xy", "out", "up", "down", "logits")
# The beginning-of-sequence id of the recurrentgemma tokenizer (the engine's default).
BOS_ID = 2
# Smallest positive temperature: FP32 holds 1 / MIN_TEMPERATURE with room to spare.
MIN_TEMPERATURE = 1e-6


def _sampling(temperature, top_k, V: int) -> tuple[float, int | None]:
    """(temperature, top_k) checked: temperature 0 is greedy, else sample softmax(logits / t)
    over the top_k logits."""
    t = float(temperature)
    if not (t == 0 or t >= MIN_TEMPERATURE):        # NaN fails both
        raise ValueError(f"expected temperature 0 (greedy) or at least {MIN_TEMPERATURE:g} (the logits are "
                         f"divided by it in FP32), got {temperature!r}")
    if top_k is None:
        return t, None
    try:        # an int of any kind (numpy, a 0-d tensor), not a bool or a float
        k = None if isinstance(top_k, bool) else operator.index(top_k)
    except TypeError:
        k = None
    if k is None or not 1 <= k <= V:
        raise ValueError(f"expected top_k None or an int in [1, vocab_size = {V}], got {top_k!r}")
    return t, k


@dataclass
class _Slot:
    """Static decoding state of one batch size (see the module docstring)."""

    B: int
    kernels: str
    cache: HawkCache
    tokens: torch.Tensor        # [B] int64, next input token (after a step: the chosen token)
    pos: torch.Tensor           # [B] int64, position of `tokens`
    reset: torch.Tensor         # [B] bool, pos == 0
    done: torch.Tensor          # [B] bool, row emitted a stop token
    stops: torch.Tensor         # [MAX_STOP_TOKENS] int64, -1 = unused
    temperature: torch.Tensor   # [] float32
    workspace: dk.Workspace | None = None   # split-K partials of the weight-streaming linears
    graphs: dict = field(default_factory=dict)
    logits: torch.Tensor | None = None

    def state(self) -> list[torch.Tensor]:
        out = [self.tokens, self.pos, self.reset, self.done]
        for c in self.cache.layers:
            out += [c.conv_state, c.rnn_state]
        return out


def _ids(v, name: str, scalar: bool = False) -> torch.Tensor:
    """Token ids (a sequence, tensor or array; `scalar`: or one int) -> int64 [n], never
    rounded; anything else raises ValueError."""
    what = f"expected {name} a sequence of integer token ids, got"
    if isinstance(v, (str, bytes)):
        raise ValueError(f"{what} {v!r} ({type(v).__name__})")
    try:
        t = torch.as_tensor(v)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{what} {v!r} ({e})") from None
    if t.numel() and ((t.dim() > 1 if scalar else t.dim() != 1) or not is_integer_dtype(t.dtype)):
        raise ValueError(f"{what} {shape_str(t)} {t.dtype}")
    return t.to(torch.int64).reshape(-1)


class Engine:
    """Generation for one HawkLM. `graphs`: capture and replay the step (default: on CUDA);
    `pdl`: programmatic dependent launch between the weight-streaming linears (None: on
    compute capability >= 9); `linear_configs`: their tiles by role (LINEAR_ROLES)."""

    def __init__(self, model: HawkLM, *, kernels: str = "auto", graphs: bool | None = None, pdl: bool | None = None,
                 prefill_chunk: int = 1024, bos_id: int = BOS_ID, pad_id: int = 0,
                 linear_configs: dict | None = None):
        if not isinstance(model, HawkLM):
            raise ValueError(f"expected model to be a HawkLM, got {type(model).__name__}")
        if kernels not in KERNELS:
            raise ValueError(f"expected kernels in {list(KERNELS)}, got {kernels!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"expected prefill_chunk a positive int, got {prefill_chunk!r}")
        V = model.config.vocab_size
        for n, v in (("bos_id", bos_id), ("pad_id", pad_id)):
            if not isinstance(v, int) or not 0 <= v < V:
                raise ValueError(f"expected {n} an int in [0, {V}), got {v!r}")
        self.model = model
        self.device = model.device
        self.dtype = model.embed.weight.dtype
        cuda = self.device.type == "cuda"
        graphs = cuda if graphs is None else graphs
        if graphs and not cuda:
            raise ValueError(f"expected graphs=False on {self.device} (CUDA graphs need a CUDA model)")
        fusable = self.dtype in (torch.bfloat16, torch.float16, torch.float32)
        if kernels == "auto" and not (cuda and fusable):
            kernels = "model"
        elif kernels == "auto" and self.dtype == torch.float32:
            kernels = "fused"
        elif kernels != "model" and not fusable:
            raise ValueError(f"expected a bf16, fp16 or fp32 model for kernels={kernels!r}, got {self.dtype} "
                             f"(use kernels='model')")
        if pdl is None:
            pdl = cuda and torch.cuda.get_device_capability(self.device)[0] >= 9
        self.kernels, self.graphs, self.pdl = kernels, bool(graphs), bool(pdl)
        self.prefill_chunk, self.bos_id, self.pad_id = prefill_chunk, bos_id, pad_id
        self.linear_configs = dict(linear_configs or {})
        self._slots: dict[int, _Slot] = {}
        self._cur: _Slot | None = None
        self._sampling: tuple[bool, int | None] = (True, None)     # (greedy, top_k)
        self._generator: torch.Generator | None = None
        self._has_stops = False
        self._step_kw: list[dict] = [{} for _ in model.blocks]     # per block, its mixer's extra step arguments

    def _kernels_for(self, B: int) -> str:
        """The step kernels of batch size B ("auto" here means a bf16/fp16 CUDA model)."""
        if self.kernels == "auto":
            return "gemm" if B <= AUTO_GEMM_MAX_ROWS else "fused"
        return "fused" if self.kernels == "gemm" and B > dk.LINEAR_MAX_ROWS else self.kernels

    def _slot(self, B: int) -> _Slot:
        s = self._slots.get(B)
        if s is None:
            dev, kernels = self.device, self._kernels_for(B)
            tokens, pos, reset, done = (torch.zeros(B, dtype=t, device=dev)
                                        for t in (torch.int64, torch.int64, torch.bool, torch.bool))
            s = self._slots[B] = _Slot(
                B=B, kernels=kernels, cache=self.model.init_cache(B), tokens=tokens, pos=pos, reset=reset, done=done,
                stops=torch.full((dk.MAX_STOP_TOKENS,), -1, dtype=torch.int64, device=dev),
                temperature=torch.ones((), dtype=torch.float32, device=dev),
                workspace=dk.Workspace(dev) if kernels == "gemm" else None)
        return s

    @property
    def cache(self) -> HawkCache | None:
        """The cache of the current batch (after `start`)."""
        return None if self._cur is None else self._cur.cache

    @property
    def done(self) -> torch.Tensor | None:
        return None if self._cur is None else self._cur.done

    def describe(self, batch_size: int | None = None) -> dict:
        """What the engine runs: step kernels, mixer step backend, graphs, PDL."""
        B = batch_size or (self._cur.B if self._cur else 1)
        kernels = self._kernels_for(B)
        mixer = self.model.blocks[0].recurrent_block.mixer
        x = torch.empty(B, self.model.config.lru_width, dtype=self.dtype, device=self.device)
        fn = ops.resolve_step(self.model.config.mixer, mixer.step_backend, x)
        fn = getattr(fn, "func", fn)
        step = next((n for n, f in ops.step_backends(self.model.config.mixer).items() if f is fn), None)
        return {"kernels": kernels, "mixer_step_backend": step, "graphs": self.graphs,
                "pdl": self.pdl and kernels == "gemm", "prefill_chunk": self.prefill_chunk,
                "linear_configs": dict(self.linear_configs)}

    def _prompt_batch(self, prompts, lengths):
        """(tokens [B, P], lengths [B]): prompts left-padded, an empty row made [bos_id]."""
        V = self.model.config.vocab_size
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() != 2 or not is_integer_dtype(prompts.dtype):
                raise ValueError(f"expected prompts an integer tensor of shape [B, P], got {shape_str(prompts)} "
                                 f"{prompts.dtype}")
            tokens = prompts.to(self.device, torch.int64)
            lengths = torch.full(prompts.shape[:1], prompts.shape[1]) if lengths is None else torch.as_tensor(lengths)
            if not is_integer_dtype(lengths.dtype):    # a float length would be truncated, a bool one read as 0 / 1
                raise ValueError(f"expected lengths with an integer dtype, got {lengths.dtype}")
            if lengths.shape != prompts.shape[:1]:
                raise ValueError(f"expected lengths of shape [{prompts.shape[0]}], got {list(lengths.shape)}")
        else:
            if lengths is not None:
                raise ValueError("expected lengths only with a [B, P] prompt tensor (a list of prompts "
                                 "carries its own lengths)")
            seqs = [_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
            if not seqs:
                raise ValueError("expected at least one prompt, got none")
            lengths = torch.tensor([len(q) for q in seqs])
            tokens = torch.full((len(seqs), int(lengths.max())), self.pad_id, dtype=torch.int64)
            for row, q in zip(tokens, seqs):
                row[row.shape[0] - len(q):] = q
            tokens = tokens.to(self.device)
        P, lengths = tokens.shape[1], lengths.to("cpu", torch.int64)
        if bool(((lengths < 0) | (lengths > P)).any()):
            raise ValueError(f"expected every prompt length in [0, {P}], got {lengths.tolist()}")
        if P == 0:
            tokens, P = torch.full((len(lengths), 1), self.pad_id, dtype=torch.int64, device=self.device), 1
        empty = lengths == 0
        if bool(empty.any()):
            tokens = tokens.clone()     # the caller's tensor is left alone
            tokens[empty.to(tokens.device), P - 1] = self.bos_id
            lengths = torch.where(empty, 1, lengths)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= V):
            raise ValueError(f"expected prompt tokens in [0, {V}), got values in "
                             f"[{int(tokens.min())}, {int(tokens.max())}]")
        return tokens, lengths.to(self.device)

    @torch.no_grad()
    def _prefill(self, s: _Slot, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        P = tokens.shape[1]
        for c in s.cache.layers:
            c.conv_state.zero_()
            c.rnn_state.zero_()
        s.done.zero_()
        # recurrentgemma's sampler: position t - (P - length), pads at -1.
        pos = (torch.arange(P, device=self.device)[None, :] - (P - lengths)[:, None]).clamp_(min=-1)
        if P > 1:
            m = self.model
            caches = [None] * len(m.blocks)
            for c0 in range(0, P - 1, self.prefill_chunk):
                sl = slice(c0, min(c0 + self.prefill_chunk, P - 1))
                x = m.embed(tokens[:, sl])
                for i, block in enumerate(m.blocks):
                    x, caches[i] = block(x, pos[:, sl], caches[i], True)
            del x
            for dst, src in zip(s.cache.layers, caches):
                dst.conv_state.copy_(src.conv_state)
                dst.rnn_state.copy_(src.rnn_state)
        s.tokens.copy_(tokens[:, -1])
        s.pos.copy_(pos[:, -1])
        torch.eq(s.pos, 0, out=s.reset)

    @torch.no_grad()
    def start(self, prompts=None, *, batch_size: int | None = None, lengths=None, temperature: float = 0.0,
              top_k: int | None = None, stop_tokens: Sequence[int] = (),
              generator: torch.Generator | None = None) -> int:
        """Prefill a prompt batch and make it the current batch; returns B. prompts: None
        (batch_size empty prompts), a [B, P] integer tensor (`lengths` [B]: each row's real
        tokens are its last lengths[b]) or a list of token sequences. stop_tokens: at most
        MAX_STOP_TOKENS ids after which a row emits pad_id; generator: for sampling."""
        V = self.model.config.vocab_size
        temperature, top_k = _sampling(temperature, top_k, V)
        stops = _ids(stop_tokens, "stop_tokens", scalar=True).tolist()
        if len(stops) > dk.MAX_STOP_TOKENS:
            raise ValueError(f"expected at most {dk.MAX_STOP_TOKENS} stop tokens, got {len(stops)}")
        if any(not 0 <= t < V for t in stops):
            raise ValueError(f"expected stop tokens in [0, {V}), got {stops}")
        if generator is not None and (not isinstance(generator, torch.Generator)
                                      or generator.device.type != self.device.type):
            raise ValueError(f"expected generator a torch.Generator on {self.device}, got {generator!r}")
        if prompts is None:
            if not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"expected batch_size a positive int with empty prompts, got {batch_size!r}")
            prompts = torch.zeros(batch_size, 0, dtype=torch.int64)
        elif batch_size is not None:
            raise ValueError("expected batch_size only with empty prompts (prompts=None)")
        tokens, lengths = self._prompt_batch(prompts, lengths)
        s = self._slot(tokens.shape[0])
        self._refresh_step_kw()
        self._prefill(s, tokens, lengths)
        s.stops.copy_(torch.tensor(stops + [-1] * (dk.MAX_STOP_TOKENS - len(stops)), dtype=torch.int64))
        s.temperature.fill_(temperature or 1.0)
        self._cur, self._sampling, self._generator = s, (temperature == 0, top_k), generator
        self._has_stops = bool(stops)
        return s.B

    def _refresh_step_kw(self) -> None:
        """Per block, its mixer step's extra arguments: a SAMU layer's mode table of the
        current parameters, written into the tensors captured graphs read (never freed)."""
        for kw, block in zip(self._step_kw, self.model.blocks):
            mixer = block.recurrent_block.mixer
            tab = mixer.decode_modes(self.dtype) if isinstance(mixer, SAMU) else None
            if tab is not None and "modes" in kw:
                kw["modes"].copy_(tab)
            elif tab is not None:
                kw["modes"] = tab

    def _logits_model(self, s: _Slot) -> torch.Tensor:
        m = self.model
        x = m.embed(s.tokens)
        for block, c, mkw in zip(m.blocks, s.cache.layers, self._step_kw):
            x = block.step(x, c, s.reset, **mkw)
        return m.logits(x)

    def _logits_fused(self, s: _Slot) -> torch.Tensor:
        m = self.model
        n0 = m.blocks[0].temporal_pre_norm
        x, xn = dk.embed_rmsnorm(s.tokens, m.embed.weight, n0.scale, n0.eps)
        for i, (block, c, mkw) in enumerate(zip(m.blocks, s.cache.layers, self._step_kw)):
            rb, mlp = block.recurrent_block, block.mlp_block
            hy = F.linear(xn, rb.linear_y.weight, rb.linear_y.bias)
            hx = F.linear(xn, rb.linear_x.weight, rb.linear_x.bias)
            xc = dk.conv_step(hx, c.conv_state, rb.conv_1d.w, rb.conv_1d.b, s.reset)
            mo = rb.mixer.step(xc, c.rnn_state, s.reset, **mkw)
            o = F.linear(gelu_mul(hy, mo), rb.linear_out.weight, rb.linear_out.bias)
            cn = block.channel_pre_norm
            xn = dk.add_rmsnorm(o, x, cn.scale, cn.eps)
            u = F.linear(xn, mlp.ffw_up.weight, mlp.ffw_up.bias)
            o = F.linear(geglu(u), mlp.ffw_down.weight, mlp.ffw_down.bias)
            nn_ = m.blocks[i + 1].temporal_pre_norm if i + 1 < len(m.blocks) else m.final_norm
            xn = dk.add_rmsnorm(o, x, nn_.scale, nn_.eps)
        return F.linear(xn, m.embed.weight)

    def _logits_gemm(self, s: _Slot) -> torch.Tensor:
        m, cfg = self.model, self.linear_configs
        kw = dict(pdl=self.pdl, workspace=s.workspace)
        x = F.embedding(s.tokens, m.embed.weight)
        for block, c, mkw in zip(m.blocks, s.cache.layers, self._step_kw):
            rb, mlp = block.recurrent_block, block.mlp_block
            tn, cn = block.temporal_pre_norm, block.channel_pre_norm
            gy, xc = dk.linear(x, rb.linear_y.weight, rb.linear_y.bias, prologue=dk.PRO_NORM, norm_scale=tn.scale,
                               eps=tn.eps, epilogue=dk.EPI_XY, w2=rb.linear_x.weight, bias2=rb.linear_x.bias,
                               conv=(c.conv_state, rb.conv_1d.w, rb.conv_1d.b), reset=s.reset,
                               config=cfg.get("xy"), **kw)
            mo = rb.mixer.step(xc, c.rnn_state, s.reset, **mkw)
            dk.linear(gy, rb.linear_out.weight, rb.linear_out.bias, prologue=dk.PRO_MUL, a2=mo,
                      epilogue=dk.EPI_RESIDUAL, residual=x, config=cfg.get("out"), **kw)
            p = dk.linear(x, mlp.ffw_up.weight, mlp.ffw_up.bias, prologue=dk.PRO_NORM, norm_scale=cn.scale,
                          eps=cn.eps, epilogue=dk.EPI_GATED, config=cfg.get("up"), **kw)
            dk.linear(p, mlp.ffw_down.weight, mlp.ffw_down.bias, epilogue=dk.EPI_RESIDUAL, residual=x,
                      config=cfg.get("down"), **kw)
        fn = m.final_norm
        return dk.linear(x, m.embed.weight, None, prologue=dk.PRO_NORM, norm_scale=fn.scale, eps=fn.eps,
                         config=cfg.get("logits"), **kw)

    def _choose(self, s: _Slot, logits: torch.Tensor, sampling, generator) -> torch.Tensor:
        greedy, top_k = sampling
        if greedy:
            return logits.argmax(dim=-1)
        # Shifted by the row maximum first: at small temperatures the quotient may
        # overflow to -inf (probability 0), never to +inf (inf - inf would be NaN).
        lg = logits.float()
        lg = (lg - lg.amax(dim=-1, keepdim=True)) / s.temperature
        if top_k is not None:
            kth = torch.topk(lg, top_k, dim=-1).values[:, -1:]
            lg = lg.masked_fill(lg < kth, float("-inf"))
        probs = torch.softmax(lg, dim=-1)
        # Exponential race: argmax(p / q), q ~ Exp(1), samples Categorical(p) without
        # the host synchronisation of torch.multinomial.
        q = torch.empty_like(probs).exponential_(generator=generator)
        return (probs / q).argmax(dim=-1)

    def _advance(self, s: _Slot, nxt: torch.Tensor) -> None:
        if s.kernels == "model":
            hit = (nxt[:, None] == s.stops[None, :]).any(dim=-1)
            s.tokens.copy_(torch.where(s.done, self.pad_id, nxt))
            s.done.logical_or_(hit)
            s.pos.add_(1)
            torch.eq(s.pos, 0, out=s.reset)
        else:
            dk.advance(nxt, s.tokens, s.pos, s.reset, s.done, s.stops, self.pad_id)

    def _body(self, s: _Slot, sampling, generator) -> torch.Tensor:
        logits = {"model": self._logits_model, "fused": self._logits_fused, "gemm": self._logits_gemm}[s.kernels](s)
        self._advance(s, self._choose(s, logits, sampling, generator))
        return logits

    def _capture(self, s: _Slot, sampling, generator):
        saved = [t.clone() for t in s.state()]
        # The warm-up must leave no trace: decoding state and random-number state are
        # restored, so a sampled graph run draws what an eager run would.
        rng = generator.get_state() if generator is not None else torch.cuda.get_rng_state(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):      # compiles the Triton kernels, initialises the libraries
                self._body(s, sampling, generator)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, v in zip(s.state(), saved):
            t.copy_(v)
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            generator.set_state(rng)
            graph.register_generator_state(generator)
        else:
            torch.cuda.set_rng_state(rng, self.device)
        with torch.cuda.graph(graph):
            logits = self._body(s, sampling, generator)
        return graph, logits

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One decode step of the current batch: returns the chosen tokens [B] (the
        engine's static buffer: copy it before the next step to keep it)."""
        s = self._cur
        if s is None:
            raise ValueError("expected start(...) before step(): no current batch")
        if not self.graphs:
            s.logits = self._body(s, self._sampling, self._generator)
            return s.tokens
        key = (*self._sampling, None if self._generator is None else id(self._generator))
        entry = s.graphs.get(key)
        if entry is None:
            entry = s.graphs[key] = (*self._capture(s, self._sampling, self._generator), self._generator)
        entry[0].replay()
        s.logits = entry[1]
        return s.tokens

    @torch.no_grad()
    def stream(self, prompts=None, max_new_tokens: int = 1, *, with_logits: bool = False, sync_every: int = 8,
               **start_kw) -> Iterator:
        """start(prompts, **start_kw), then yield each step's tokens [B] (stopped rows: pad_id),
        or (tokens, logits [B, V]) with with_logits. With stop tokens it ends once every row
        has stopped, checked every `sync_every` steps (one host synchronisation each)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"expected max_new_tokens a non-negative int, got {max_new_tokens!r}")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"expected sync_every a positive int, got {sync_every!r}")
        self.start(prompts, **start_kw)
        s = self._cur
        for i in range(max_new_tokens):
            tok = self.step()
            yield (tok.clone(), s.logits.clone()) if with_logits else tok.clone()
            if self._has_stops and (i + 1) % sync_every == 0 and bool(s.done.all()):
                return

    def generate(self, prompts=None, max_new_tokens: int = 1, **start_kw) -> torch.Tensor:
        """New tokens [B, max_new_tokens] for a prompt batch (arguments as in `start`);
        after a row emits a stop token it holds pad_id."""
        steps = list(self.stream(prompts, max_new_tokens, sync_every=32, **start_kw))
        out = torch.full((self._cur.B, max_new_tokens), self.pad_id, dtype=torch.int64, device=self.device)
        if steps:
            out[:, :len(steps)] = torch.stack(steps, 1)
        return out


__all__ = ["Engine", "KERNELS", "AUTO_GEMM_MAX_ROWS", "BOS_ID", "MIN_TEMPERATURE"]
