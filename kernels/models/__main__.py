"""Smoke run of a Hawk model: random weights, a forward over a random prompt, then
greedy generation.  python -m kernels.models --preset tiny --mixer samu"""

from __future__ import annotations

import argparse
import time

import torch

from . import PRESETS, HawkConfig, HawkLM


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kernels.models", description=__doc__)
    p.add_argument("--preset", default="tiny", choices=PRESETS)
    p.add_argument("--mixer", default="both", choices=["rglru", "samu", "both"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for mixer in ("rglru", "samu") if a.mixer == "both" else (a.mixer,):
        torch.manual_seed(a.seed)
        cfg = HawkConfig.preset(a.preset, mixer=mixer)
        model = HawkLM(cfg, backend=a.backend, device=a.device).eval()
        prompt = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_len), device=a.device)
        pos = torch.arange(a.prompt_len, device=a.device).expand_as(prompt)
        with torch.no_grad():
            logits, cache = model(prompt, pos)
        t0 = time.perf_counter()
        out = model.generate(prompt, a.new_tokens)
        dt = time.perf_counter() - t0
        print(f"{cfg.name} / {mixer}: {cfg.non_embedding_parameters() / 1e6:.2f}M non-embedding parameters, "
              f"forward logits {list(logits.shape)}, state per layer {list(cache.layers[0].rnn_state.shape)} "
              f"{str(cache.layers[0].rnn_state.dtype).removeprefix('torch.')}, generated {list(out.shape)} in "
              f"{dt:.2f} s ({a.batch * a.new_tokens / dt:.0f} tokens/s, eager, {a.device}); "
              f"first row: {out[0].tolist()}")


if __name__ == "__main__":
    main()
