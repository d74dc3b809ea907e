"""Which profile of config.yaml runs: `auto` picks by the first GPU NVML reports (H200 -> h200, H800 -> h800, none or
all hidden by CUDA_VISIBLE_DEVICES -> cpu-smoke); a GPU without a profile is an error saying how to choose one."""

from __future__ import annotations

import os

GPU_PROFILES = {"H200": "h200", "H800": "h800"}
CPU_PROFILE = "cpu-smoke"


def gpu_names() -> list[str]:
    """Names of the GPUs NVML sees ([] without NVML or with every GPU hidden)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no nvidia-ml-py or no driver: no GPU to name
        return []
    try:
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())]
        return [n.decode() if isinstance(n, bytes) else n for n in names]
    finally:
        pynvml.nvmlShutdown()


def profile_for_gpu(names: list[str], known: list[str]) -> str:
    if not names:
        return CPU_PROFILE
    for key, profile in GPU_PROFILES.items():
        if key in names[0].upper() and profile in known:
            return profile
    raise ValueError(f"profile: auto found GPU {names[0]!r}, which has no profile in config.yaml "
                     f"(profiles: {sorted(known)}); run with --config profile=<name> to pick one")


def resolve_profile(config: dict, gpus: list[str] | None = None) -> tuple[str, dict]:
    profiles, name = config.get("profiles") or {}, config.get("profile", "auto")
    if name == "auto":
        name = profile_for_gpu(gpu_names() if gpus is None else gpus, list(profiles))
    if name not in profiles:
        raise ValueError(f"expected profile in {['auto', *sorted(profiles)]}, got {name!r} (config key 'profile')")
    return name, profiles[name]


def choice(wanted: str, name: str, gpus: list[str]) -> str:
    """The console line that says which profile runs and why."""
    if wanted == "auto":
        found = f"GPU {gpus[0]!r}" if gpus else "no GPU visible"
        return f"profile: auto -> {name} ({found})"
    return f"profile: {name} (chosen in the config)"
