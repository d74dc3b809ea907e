"""Generate with a Hawk model and report the decode speed.

    python -m kernels.generate --preset 1.3b --mixer samu --batch 16 --prompt-len 0 \\
        --new-tokens 128 [--checkpoint PATH] [--dtype bf16] [--device cuda]

Weights are random from a preset or come from a checkpoint: an official recurrentgemma
state dict of an all-recurrent Griffin (loaded as the study's Hawk), or a HawkLM state dict
(the preset and --mixer must describe it). Prompts are random tokens after a BOS. Prints
the prefill time, ms per decode step and tokens/s (--json: also one JSON object), medians
of RUNS timed runs after an untimed one. With $KERNELS_TUNING_TABLE set, "auto" mixer backends
and the weight-streaming linears' tiles come from that table, as in the pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from .models import PRESETS, HawkConfig, HawkLM
from .models import decode as dk
from .models.generation import KERNELS, Engine
from .ops import tuning

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
RUNS = 3        # timed runs of the generation, after an untimed one


def load_checkpoint(path: str, *, preset: str, mixer: str, device, dtype, backend: str = "auto") -> HawkLM:
    """A HawkLM from a checkpoint file (see the module docstring)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"expected {path} to hold a state dict, got {type(state).__name__}")
    if "embedder.input_embedding" in state:
        attention = sorted({k.split(".")[1] for k in state if ".attention_block." in k and k.startswith("blocks.")},
                           key=int)
        if attention:
            raise ValueError(f"expected an all-recurrent (Hawk) checkpoint, but {path} has local-attention blocks "
                             f"(Griffin) at layers {attention}; those cannot be converted")
        from . import convert
        from .official import load_official

        rg = load_official()
        cfg = rg.GriffinConfig.from_torch_params(state, embeddings_scale_by_sqrt_dim=False, attention_window_size=2048,
                                                  logits_soft_cap=0.0, scan_type=rg.ScanType.AUTO)
        official = rg.Griffin(cfg, gradient_checkpointing=False, device="meta")
        official.load_state_dict(state, strict=True, assign=True)
        return convert.from_recurrentgemma(official.to(device=device, dtype=dtype), backend=backend).eval()
    if "embed.weight" in state:
        cfg = HawkConfig.preset(preset, mixer=mixer, vocab_size=state["embed.weight"].shape[0])
        model = HawkLM(cfg, backend=backend, device="meta")
        model.load_state_dict(state, strict=True, assign=True)
        return model.to(device=device, dtype=dtype).eval()
    raise ValueError(f"expected {path} to be an official recurrentgemma state dict (embedder.input_embedding) "
                     f"or a HawkLM state dict (embed.weight), got keys {sorted(state)[:5]}...")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m kernels.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=PRESETS)
    p.add_argument("--mixer", default="rglru", choices=["rglru", "samu"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=0, help="prompt tokens per row including BOS (0: BOS alone)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", default="auto", choices=list(KERNELS))
    p.add_argument("--backend", default="auto", help="mixer backend of the model (prefill and step)")
    p.add_argument("--no-graphs", action="store_true", help="run the step eagerly on CUDA")
    p.add_argument("--pdl", default="auto", choices=["auto", "on", "off"],
                   help="programmatic dependent launch between linears (auto: on Hopper and newer)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--stop", type=int, nargs="*", default=[], help="stop token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON object (last line)")
    a = p.parse_args(argv)
    for n, lo in (("batch", 1), ("new_tokens", 1), ("prompt_len", 0), ("top_k", 1)):
        if getattr(a, n) is not None and getattr(a, n) < lo:
            p.error(f"--{n.replace('_', '-')} must be at least {lo}, got {getattr(a, n)}")
    if not a.temperature >= 0:
        p.error(f"--temperature must be >= 0, got {a.temperature}")
    if a.top_k is not None and a.temperature == 0:
        p.error("--top-k needs --temperature > 0 (temperature 0 is greedy decoding)")
    if a.checkpoint and not os.path.isfile(a.checkpoint):
        p.error(f"--checkpoint {a.checkpoint}: no such file")
    try:
        device = torch.device(a.device)
    except RuntimeError as e:
        p.error(f"--device {a.device}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    dtype = DTYPES[a.dtype]
    torch.manual_seed(a.seed)
    try:
        if a.checkpoint:
            model = load_checkpoint(a.checkpoint, preset=a.preset, mixer=a.mixer, device=device, dtype=dtype,
                                    backend=a.backend)
        else:
            model = HawkLM(HawkConfig.preset(a.preset, mixer=a.mixer), backend=a.backend, device=device,
                           dtype=dtype).eval()
    except (ValueError, RuntimeError) as e:      # RuntimeError: load_state_dict's key or shape mismatch
        p.error(f"cannot build the model: {e}")
    model.requires_grad_(False)
    cfg = model.config
    if any(not 0 <= t < cfg.vocab_size for t in a.stop):
        p.error(f"--stop ids must lie in [0, {cfg.vocab_size}), got {a.stop}")
    try:
        table = tuning.env_table()
    except ValueError as e:
        p.error(str(e))
    linear_configs = None if table is None or device.type != "cuda" else table.linear_configs(
        str(dtype).removeprefix("torch."), dk.rows_block(a.batch), gpu=torch.cuda.get_device_name(device))
    try:
        engine = Engine(model, kernels=a.kernels, graphs=False if a.no_graphs else None,
                        pdl={"auto": None, "on": True, "off": False}[a.pdl], linear_configs=linear_configs)
    except ValueError as e:
        p.error(str(e))
    prompts = None
    if a.prompt_len:
        g = torch.Generator().manual_seed(a.seed)
        prompts = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_len), generator=g)
        prompts[:, 0] = engine.bos_id
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(a.seed) if a.temperature > 0 else None
    kw = dict(batch_size=None if prompts is not None else a.batch, temperature=a.temperature, top_k=a.top_k,
              stop_tokens=a.stop, generator=gen)
    # An untimed run of the same generation (graph capture, compilation, the GPU's working clock), then RUNS timed
    # ones: the figures are their medians, as the inference track's are of its trajectories.
    out = torch.empty(a.batch, a.new_tokens, dtype=torch.int64, device=device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
    prefill, decode = [], []
    for run in range(RUNS + 1):
        t0 = time.perf_counter()
        engine.start(prompts, **kw)
        sync()
        prefill.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if events:
            events[0].record()
        for i in range(a.new_tokens):
            tokens = engine.step()
            if run == 0:    # the untimed run keeps the tokens; the timed ones run the steps alone, as the track's do
                out[:, i].copy_(tokens)
        if events:
            events[1].record()
            events[1].synchronize()
        decode.append(events[0].elapsed_time(events[1]) if events else (time.perf_counter() - t0) * 1e3)
    prefill_s, ms = statistics.median(prefill[1:]), statistics.median(decode[1:]) / a.new_tokens
    info = engine.describe()
    result = {"preset": cfg.name, "mixer": cfg.mixer, "batch": a.batch, "prompt_len": a.prompt_len,
              "new_tokens": a.new_tokens, "dtype": a.dtype, "device": str(device), "prefill_s": prefill_s,
              "ms_per_step": ms, "runs_ms": decode[1:], "tokens_per_s": a.batch / (ms * 1e-3), **info}
    print(f"{cfg.name} / {cfg.mixer} ({cfg.non_embedding_parameters() / 1e6:.4g}M non-embedding parameters, "
          f"{a.dtype}, {device}): batch {a.batch}, prompt {a.prompt_len}, {a.new_tokens} new tokens")
    print(f"step: kernels={info['kernels']} mixer step={info['mixer_step_backend']} graphs={info['graphs']} "
          f"pdl={info['pdl']}")
    print(f"prefill {prefill_s * 1e3:.1f} ms; decode {ms:.3f} ms/step, {result['tokens_per_s']:.0f} tokens/s")
    print(f"row 0: {out[0, :16].tolist()}{' ...' if a.new_tokens > 16 else ''}")
    if a.json:
        print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
