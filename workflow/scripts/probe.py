"""Environment probe -> results/probe/environment.json: GPUs, software and CPU, the device copy bandwidth and BF16
matmul rate, the host's cost of the smallest launches, and whether Nsight Compute can read counters."""

import csv
import importlib.metadata
import importlib.util
import os
import platform
import re
import statistics
import subprocess
import sys

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from common import atomic, facts, records, stage
from common.measure import EAGER_WARM_MS, ncu_path, number, run_for, time_fn
from kernels.ops.triton_utils import launcher

COUNTER_METRICS = ("dram__bytes_read.sum", "lts__t_bytes.sum", "sm__warps_active.avg.pct_of_peak_sustained_active")
NCU_TIMEOUT_S = 300
TINY_KERNEL = "import torch; x = torch.ones(1 << 20, device='cuda'); y = x * 2; torch.cuda.synchronize()"


def nvml_facts() -> dict:
    """Every GPU NVML reports; fields a device does not support are null."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except ImportError as e:
        return {"available": False, "reason": f"nvidia-ml-py not installed ({e})", "devices": []}
    except pynvml.NVMLError as e:  # pynvml imported: only nvmlInit raises this
        return {"available": False, "reason": f"NVML: {e}", "devices": []}

    def q(fn, *args, then=lambda v: v):
        try:
            v = fn(*args)
        except (pynvml.NVMLError, AttributeError):
            return None
        return then(v.decode() if isinstance(v, bytes) else v)

    try:
        n = pynvml
        out = {"available": True, "driver_version": q(n.nvmlSystemGetDriverVersion),
               "cuda_driver_version": q(n.nvmlSystemGetCudaDriverVersion,
                                        then=lambda v: f"{v // 1000}.{v % 1000 // 10}"),
               "nvml_version": q(n.nvmlSystemGetNVMLVersion), "devices": []}
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            clocks = {f"{label}{kind}_mhz": q(fn, h, clock)
                      for label, clock in (("sm", n.NVML_CLOCK_SM), ("memory", n.NVML_CLOCK_MEM))
                      for kind, fn in (("", n.nvmlDeviceGetClockInfo), ("_max", n.nvmlDeviceGetMaxClockInfo))}
            out["devices"].append({
                "index": i, "name": q(n.nvmlDeviceGetName, h), "uuid": q(n.nvmlDeviceGetUUID, h),
                "compute_capability": q(n.nvmlDeviceGetCudaComputeCapability, h, then=lambda cc: f"{cc[0]}.{cc[1]}"),
                "memory_total_bytes": q(n.nvmlDeviceGetMemoryInfo, h, then=lambda m: m.total),
                "memory_used_bytes": q(n.nvmlDeviceGetMemoryInfo, h, then=lambda m: m.used), "clocks": clocks,
                "power_limit_w": q(n.nvmlDeviceGetEnforcedPowerLimit, h, then=lambda mw: mw / 1000.0),
                "ecc_mode_current": q(n.nvmlDeviceGetEccMode, h, then=lambda ecc: bool(ecc[0])),
                "ecc_mode_pending": q(n.nvmlDeviceGetEccMode, h, then=lambda ecc: bool(ecc[1])),
                "persistence_mode": q(n.nvmlDeviceGetPersistenceMode, h, then=bool),
                "temperature_c": q(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
                "pcie_link_gen_max": q(n.nvmlDeviceGetMaxPcieLinkGeneration, h)})
        return out
    finally:
        pynvml.nvmlShutdown()


def _proc(path: str, pattern: str) -> str | None:
    try:
        with open(path) as f:
            m = re.search(pattern, f.read(), re.M)
    except OSError:
        return None
    return m.group(1).strip() if m else None


def cpu_facts() -> dict:
    mem = _proc("/proc/meminfo", r"^MemTotal:\s*(\d+) kB")
    return {"model": _proc("/proc/cpuinfo", r"^model name\s*:\s*(.+)$") or platform.processor() or None,
            "logical_cores": os.cpu_count(),
            "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "memory_bytes": int(mem) * 1024 if mem else None, "machine": platform.machine(), "os": platform.platform()}


def _tool_version(cmd: list[str]) -> str | None:
    try:  # a tool not installed raises FileNotFoundError, an OSError
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else None


def software_facts() -> dict:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {**facts.versions(), "cudnn": cudnn, "nvcc": _tool_version(["nvcc", "--version"]),
            "ncu": _tool_version([ncu_path() or "ncu", "--version"]),
            "triton_interpret": os.environ.get("TRITON_INTERPRET"), "executable": sys.executable,
            **{name: importlib.metadata.version(name) if importlib.util.find_spec(name) else None
               for name in ("numpy", "pandas", "snakemake", "matplotlib")}}


def measure(device: str, settings: dict) -> dict:
    """The two ceilings later stages divide by (copy bandwidth counts bytes read + written)."""
    reps, n_bytes, n = settings["reps"], settings["copy_bytes"], settings["matmul_n"]
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy = time_fn(lambda: dst.copy_(src), reps=reps, warmup=3, device=device)
    copy_bps = 2 * n_bytes / (copy["median_ms"] * 1e-3)
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    mm = time_fn(lambda: a @ b, reps=reps, warmup=3, device=device)
    flops = 2 * n**3 / (mm["median_ms"] * 1e-3)
    return {"device": device, "copy": {"buffer_bytes": n_bytes, "bytes_moved": 2 * n_bytes, "timing": copy},
            "matmul_bf16": {"n": n, "flop": 2 * n**3, "timing": mm}, "copy_bandwidth_bytes_per_s": copy_bps,
            "matmul_bf16_flop_per_s": flops, "host_launch": host_launch(device, max(reps, 50))}


@launcher
@triton.jit
def _touch(x):
    # the smallest kernel: one load and one store
    tl.store(x, tl.load(x) + 1)


def host_launch(device: str, reps: int) -> dict | None:
    """Host time per call of the smallest launches after EAGER_WARM_MS back to back, as the eager
    clock takes them: a Triton kernel through our launcher and through Triton's binding, one
    PyTorch op, and the first again after one torch.profiler session. None off CUDA."""
    if device != "cuda":
        return None
    x = torch.zeros(1, device=device)
    calls = {"triton_launcher": lambda: _touch[(1,)](x), "triton_jit": lambda: _touch.fn[(1,)](x),
             "torch_add": lambda: x.add_(1)}

    def host(fn):
        run_for(fn, torch.device(device), EAGER_WARM_MS)
        t = time_fn(fn, reps=reps, warmup=0, device=device)
        return {"host_median_us": statistics.median(t["host_ms"]) * 1e3, "eager_median_us": t["median_ms"] * 1e3,
                "host_samples_ms": t["host_ms"]}

    out = {name: host(fn) for name, fn in calls.items()}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        calls["triton_launcher"]()
        torch.cuda.synchronize()
    out["triton_launcher_after_profiler"] = host(calls["triton_launcher"])
    return {"calls": out, "teardown_cupti": os.environ.get("TEARDOWN_CUPTI")}


def interpret_ncu(returncode: int | None, output: str) -> tuple[bool, str]:
    """(counters_available, reason) from an Nsight Compute run over TINY_KERNEL."""
    if "ERR_NVGPUCTRPERM" in output:
        return False, ("ERR_NVGPUCTRPERM: the driver restricts GPU performance counters to admin users "
                       "(NVreg_RestrictProfilingToAdminUsers); counters are left empty")
    for marker in ("LibraryNotLoaded", "Failed to initialize the profiler", "==ERROR==", "No kernels were profiled"):
        if marker in output:
            line = next((ln.strip() for ln in output.splitlines() if marker in ln), marker)
            return False, f"ncu failed: {line[:300]}"
    if returncode != 0:
        tail = " | ".join(output.strip().splitlines()[-3:])
        return False, f"ncu exited with status {returncode}: {tail[:300]}"
    # metric name -> value as printed (`ncu --csv`); non-numbers (n/a) left out
    rows = csv.DictReader(ln for ln in output.splitlines() if ln.startswith('"'))
    values = {r["Metric Name"]: r["Metric Value"].replace(",", "") for r in rows
              if r.get("Metric Name") and number(r.get("Metric Value")) is not None}
    if not (found := [m for m in COUNTER_METRICS if m in values]):
        return False, "ncu ran but reported none of the requested metrics"
    return True, "ncu read " + ", ".join(f"{m}={values[m]}" for m in found)


def counter_check(has_gpu: bool) -> dict:
    base = {"tool": "ncu", "metrics": list(COUNTER_METRICS)}
    if not has_gpu:
        return {**base, "counters_available": False, "reason": "no GPU: hardware counters not applicable"}
    if (ncu := ncu_path()) is None:
        return {**base, "counters_available": False, "reason": "ncu (Nsight Compute) not found on PATH"}
    cmd = [ncu, "--target-processes", "all", "--launch-count", "1", "--csv",
           "--metrics", ",".join(COUNTER_METRICS), sys.executable, "-c", TINY_KERNEL]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=NCU_TIMEOUT_S)
        rc, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, f"ncu timed out after {NCU_TIMEOUT_S} s {e.stdout or ''}"
    except OSError as e:
        rc, text = None, f"could not start ncu: {e}"
    available, reason = interpret_ncu(rc, text)
    return {**base, "command": cmd[:-1] + ["<tiny kernel>"], "returncode": rc,
            "counters_available": available, "reason": reason, "output_tail": text[-2000:]}


def main(job):
    has_gpu, gpu = torch.cuda.is_available(), nvml_facts()
    inside = any(os.environ.get(v) for v in (stage.IN_CONTAINER, "APPTAINER_CONTAINER", "SINGULARITY_CONTAINER"))
    env = {"schema": 1, "profile": job.profile, "timestamp": records.now(), "commit": facts.commit(),
           "has_gpu": has_gpu, "gpu": gpu, "torch_device": facts.gpu(), "software": software_facts(),
           "cpu": cpu_facts(), "container": {**job.config["container"], "inside_pipeline_container": inside}}
    print(f"probe: GPU present: {has_gpu}; NVML: {gpu.get('reason') or gpu.get('driver_version')}", flush=True)
    env["measured"] = measure("cuda" if has_gpu else "cpu", job.params["settings"])
    print(f"probe: copy {env['measured']['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"bf16 matmul {env['measured']['matmul_bf16_flop_per_s'] / 1e12:.2f} TFLOP/s", flush=True)
    for name, h in (env["measured"]["host_launch"] or {"calls": {}})["calls"].items():
        print(f"probe: host time of one {name} call {h['host_median_us']:.1f} us", flush=True)
    env["counters"] = counter_check(has_gpu)
    env["counters_available"] = env["counters"]["counters_available"]
    print(f"probe: counters_available={env['counters_available']} ({env['counters']['reason']})", flush=True)
    atomic.write_json(job.output.environment, env)


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
