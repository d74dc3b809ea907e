"""Checks run inside the pipeline image by containers/test_image.sh (no GPU needed):
the CUDA build of PyTorch and its CUDA libraries, every shared library's
dependencies resolved inside the image, Triton's CUDA backend compiling a kernel
for sm_90 (the H200's architecture) down to a cubin, and `pip check`."""

import glob
import os
import re
import subprocess
import sys
import sysconfig

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Provided by the host's driver at run time (the NVIDIA container runtime or
# apptainer --nv mount them), never part of an image.
DRIVER_LIBS = {"libcuda.so.1", "libnvidia-ml.so.1"}
# Optional plugins of the CUDA pip packages that PyTorch never loads: cuFile's RDMA
# transport, multi-GPU cuSOLVER (it finds cuBLAS only once that is loaded), and
# NVSHMEM's MPI / PMIx / OpenSHMEM bootstraps and InfiniBand / libfabric / UCX
# transports; their system libraries are not in the image.
OPTIONAL = re.compile(r"^nvidia/cu13/lib/(libcufile_rdma|libcusolverMg)\.so|^nvidia/nvshmem/lib/nvshmem_(bootstrap|transport)_")
SITE = sysconfig.get_paths()["purelib"]


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(1)


def unresolved(lib):
    out = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
    return set(re.findall(r"^\s*(\S+) => not found", out, re.M))


print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, triton {triton.__version__}, "
      f"arch list {torch.cuda.get_arch_list()}")
check(torch.version.cuda is not None and torch.version.cuda.startswith("13."), f"torch.version.cuda = {torch.version.cuda}")
check("sm_90" in torch.cuda.get_arch_list(), "torch's CUDA kernels include sm_90")
check(triton.__version__ == "3.6.0", f"triton {triton.__version__}")

torch_cuda = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
check(unresolved(torch_cuda) == set(), f"ldd {torch_cuda}: every dependency found in the image")
libs = sorted(set(glob.glob(f"{SITE}/torch/lib/*.so*") + glob.glob(f"{SITE}/nvidia/**/*.so*", recursive=True)
                  + glob.glob(f"{SITE}/triton/**/*.so*", recursive=True)))
missing = {os.path.relpath(lib, SITE): unresolved(lib) for lib in libs}
optional = sorted(lib for lib in missing if OPTIONAL.match(lib))
driver = sorted(lib for lib, m in missing.items() if m and lib not in optional)
beyond = {lib: m - DRIVER_LIBS for lib, m in missing.items() if m - DRIVER_LIBS and lib not in optional}
print(f"     {len(libs)} shared libraries of torch, triton and the CUDA packages; needing only the driver's "
      f"{sorted(DRIVER_LIBS)}: {driver}; optional plugins not checked: {optional}")
check(not beyond, f"ldd: every dependency of the other {len(libs) - len(optional)} found in the image or the driver's {beyond}")


@triton.jit
def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


src = ASTSource(fn=add, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                constexprs={"BLOCK": 128})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
cubin = kernel.asm["cubin"]
check(re.search(r"^\.target sm_90a?\b", kernel.asm["ptx"], re.M) is not None, "Triton: PTX for sm_90")
# ELF, e_machine 190 (EM_CUDA); the SM version sits in e_flags
e_machine = int.from_bytes(cubin[18:20], "little")
e_flags = int.from_bytes(cubin[48:52], "little")
check(cubin[:4] == b"\x7fELF" and e_machine == 190 and (e_flags & 0xFF == 90 or (e_flags >> 8) & 0xFF == 90),
      f"Triton: ptxas made a {len(cubin)}-byte cubin for sm_90 (e_flags {e_flags:#x})")

pip = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
lines = [line for line in pip.stdout.splitlines() if line.strip()]
print("     pip check: " + " | ".join(lines))
check(len(lines) == 1 and re.match(r"torch 2\.13\.0 has requirement triton==3\.7\.1.*but you have triton 3\.6\.0", lines[0]),
      "pip check: only the Triton override of containers/lock.sh")
print("image checks passed")
