#!/usr/bin/env python3
"""Does a change alter the GPU code? Compile every kernel launch of two trees for sm_90 and
compare, without a GPU.

    .venv/bin/python .ci/ptx_compare.py OLD_TREE NEW_TREE

For each tree (a checkout of this repository) it runs every op in the Triton interpreter
(rglru / scan / samu, serial and chunk, both serial layouts, forward and backward, bf16 and
fp32, the decode steps, and the training step's fused convolution and gated GeLU) and
records each kernel launch: kernel, argument types, constexprs, num_warps / num_stages. It
then compiles each launch for sm_90 with Triton's compiler (PTX needs no driver) and
compares the launches in order by PTX instruction histogram and shared memory. Exit 0
when all are equal. Kernel names may differ (kernels merged under a constexpr flag
compile to the same code). A PTX match means the same instructions, so the same speed;
a mismatch needs a GPU to time it.
"""

import collections
import json
import os
import subprocess
import sys
import tempfile

CAPTURE = r'''
import os, sys, json
os.environ["TRITON_INTERPRET"] = "1"
root, outp = sys.argv[1], sys.argv[2]
sys.path[:0] = [root, os.path.join(root, "workflow", "scripts")]
import torch
import triton.runtime.interpreter as I
specs, orig = [], I.InterpretedFunction.run
def run(self, *args, grid, warmup, **kwargs):
    names = self.arg_names
    bound = dict(zip(names, args)); bound.update({k: v for k, v in kwargs.items() if k in names})
    sig = {}
    for n in names:
        v = bound.get(n)
        if isinstance(v, torch.Tensor): sig[n] = ("ptr", str(v.dtype).removeprefix("torch."))
        elif isinstance(v, bool): sig[n] = ("val", v)
        elif isinstance(v, int): sig[n] = ("int", v)
        elif isinstance(v, float): sig[n] = ("float", v)
        else: sig[n] = ("val", repr(v))
    specs.append({"module": self.fn.__module__, "name": self.fn.__name__, "sig": sig,
                  "meta": {k: repr(v) for k, v in kwargs.items() if k not in names}})
    return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
I.InterpretedFunction.run = run
import kernels
from common import cases
for dtype in (torch.bfloat16, torch.float32):
    for op in ("rglru", "scan", "samu"):
        for be in ("serial", "chunk"):
            for opts in ([{}, {"time_warps": 1}] if be == "serial" and op != "samu" else [{}]):
                args = cases.op_inputs(op, 2, 40, 16, dtype, "cpu", requires_grad=True, resets=True)
                y = getattr(kernels, op)(*args, backend=kernels.Backend(be, **opts))[0]
                torch.autograd.grad(y, cases.grad_targets(args), torch.randn_like(y))
    for op in ("rglru", "samu"):
        a, st = cases.step_inputs(op, 4, 32, 2, dtype, "cpu")
        with torch.no_grad():
            getattr(kernels, f"{op}_step")(*a, st)
    from kernels.ops import conv, geglu
    up = torch.randn(2, 3, 80, dtype=dtype, requires_grad=True)
    h = geglu.geglu(up)
    torch.autograd.grad(h, up, torch.randn_like(h))
    g, v = (torch.randn(2, 3, 40, dtype=dtype, requires_grad=True) for _ in range(2))
    h = geglu.gelu_mul(g, v)
    torch.autograd.grad(h, (g, v), torch.randn_like(h))
    x, w, b = (torch.randn(*s, dtype=dtype, requires_grad=True) for s in ((2, 40, 16), (4, 16), (16,)))
    y = conv.causal_conv1d(x, w, b, torch.arange(40).expand(2, 40).contiguous())
    torch.autograd.grad(y, (x, w, b), torch.randn_like(y))
json.dump(specs, open(outp, "w"))
'''

COMPILE = r'''
import sys, json, importlib, collections
root, specp, outp = sys.argv[1:4]
sys.path.insert(0, root)
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
TY = {"bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "float16": "fp16", "int32": "i32", "int64": "i64",
      "uint8": "u8", "bool": "i1", "int8": "i8"}
SKIP = (".loc", ".file", "//", ".param", "ld.param", ".globl", ".visible", ".entry", "$L__", ".section", ".b8",
        ".b32", ".b64", ".reg", "{", "}", ")", "(")
out, seen = [], {}
for s in json.load(open(specp)):
    fn = getattr(importlib.import_module(s["module"]), s["name"])
    sig, consts = {}, {}
    for i, n in enumerate(fn.arg_names):
        kind, v = s["sig"][n]
        if i in fn.constexprs:
            sig[n] = "constexpr"
            consts[n] = eval(v.replace("triton.language", "tl")) if kind == "val" and isinstance(v, str) else v
        elif kind == "ptr":
            sig[n] = "*" + TY[v]
        elif kind == "int":
            sig[n] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif kind == "float":
            sig[n] = "fp32"
        else:
            sig[n], consts[n] = "constexpr", None
    opts = {k: eval(v) for k, v in s["meta"].items() if k in ("num_warps", "num_stages")}
    key = json.dumps([s["name"], sig, {k: repr(v) for k, v in consts.items()}, opts], sort_keys=True)
    if key not in seen:
        try:
            c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                               options=opts)
            ops = collections.Counter(l.strip().split()[0].rstrip(";") for l in c.asm["ptx"].splitlines()
                                      if l.strip() and not l.strip().startswith(SKIP))
            seen[key] = {"name": s["name"], "n": sum(ops.values()), "ops": dict(ops), "shared": c.metadata.shared}
        except Exception as e:  # noqa: BLE001 - reported as a difference
            seen[key] = {"name": s["name"], "error": f"{type(e).__name__}: {str(e)[:300]}"}
    out.append(seen[key])
json.dump(out, open(outp, "w"))
'''


def digest(tree: str, tmp: str, tag: str) -> list[dict]:
    py = sys.executable
    specs, ptx = os.path.join(tmp, f"{tag}.json"), os.path.join(tmp, f"{tag}_ptx.json")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([py, "-c", CAPTURE, tree, specs], check=True, env=env)
    subprocess.run([py, "-c", COMPILE, tree, specs, ptx], check=True, env=env)
    return json.load(open(ptx))


def main() -> int:
    old_tree, new_tree = (os.path.abspath(p) for p in sys.argv[1:3])
    with tempfile.TemporaryDirectory() as tmp:
        old, new = digest(old_tree, tmp, "old"), digest(new_tree, tmp, "new")
    if len(old) != len(new):
        print(f"launch counts differ: {len(old)} vs {len(new)}")
        return 1
    bad = 0
    for i, (a, b) in enumerate(zip(old, new)):
        if a.get("ops") != b.get("ops") or a.get("shared") != b.get("shared") or "error" in a or "error" in b:
            bad += 1
            d = collections.Counter(b.get("ops", {}))
            d.subtract(a.get("ops", {}))
            print(f"launch {i}: {a['name']} -> {b['name']}: {a.get('n', a.get('error'))} -> {b.get('n', b.get('error'))}"
                  f" instructions, {dict(sorted(((k, v) for k, v in d.items() if v), key=lambda kv: -abs(kv[1]))[:6])}")
    print(f"{len(old)} launches compiled for sm_90, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
