"""gpu-check's environment: XLA_FLAGS, launch/gpu_env.sh, versions, the device, CUDA and cuDNN; whether there is
an NVIDIA GPU to check at all."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

import jax
import jaxlib

from gpu_checks.table import Row

ROOT = Path(__file__).resolve().parents[2]
GPU_ENV = ROOT / "launch" / "gpu_env.sh"


def recommended_settings() -> dict[str, str]:
    """What launch/gpu_env.sh sets from a clean environment (executed rather than sourced, it prints KEY=VALUE
    lines), so this check follows the script as it changes; {} where bash or the script is missing."""
    try:
        out = subprocess.run(
            ["bash", str(GPU_ENV)],
            env={"PATH": os.environ.get("PATH", "")},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def gpu_env_applied(settings: dict[str, str]) -> tuple[bool, str]:
    """Whether every flag launch/gpu_env.sh adds is in XLA_FLAGS and its other variables are set (to any value:
    the script keeps a value already set), and what is missing."""
    if not settings:
        return False, f"could not run {GPU_ENV.relative_to(ROOT)}"
    flags = set(os.environ.get("XLA_FLAGS", "").split())
    missing = [f for f in settings.get("XLA_FLAGS", "").split() if f not in flags]
    unset = [key for key in settings if key != "XLA_FLAGS" and key not in os.environ]
    if not missing and not unset:
        return True, ", ".join(f"{key}={os.environ[key]}" for key in settings if key != "XLA_FLAGS")
    switched_off = "; LLAMA_JAX_GPU_FLAGS=off" if os.environ.get("LLAMA_JAX_GPU_FLAGS") == "off" else ""
    return (
        False,
        f"missing {len(missing)} of its flags{', unset: ' + ', '.join(unset) if unset else ''}"
        f"{switched_off}; `make gpu-check` sources it",
    )


def cuda_versions() -> dict[str, str]:
    """CUDA runtime, driver and cuDNN versions as jax loaded them; {} without a CUDA plugin."""
    try:
        from jax._src.lib import cuda_versions as versions  # private: jax exposes these nowhere else
    except ImportError:
        versions = None
    found = {}
    for name, decode in (
        ("cuda_runtime_get_version", _cuda),
        ("cuda_driver_get_version", _cuda),
        ("cudnn_get_version", _cudnn),
    ):
        try:
            found[name.removesuffix("_get_version")] = decode(int(getattr(versions, name)()))
        except Exception:  # an older plugin without this function, or no driver: report the others
            continue
    return found


def _cuda(version: int) -> str:  # 12080 -> 12.8
    return f"{version // 1000}.{version % 1000 // 10}"


def _cudnn(version: int) -> str:  # 91900 -> 9.19.0 (cuDNN 9 and later), 8907 -> 8.9.7
    return (
        f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
        if version >= 90000
        else f"{version // 1000}.{version % 1000 // 100}.{version % 100}"
    )


def environment_section() -> tuple[list[Row], dict]:
    xla_flags = os.environ.get("XLA_FLAGS", "")
    applied, applied_detail = gpu_env_applied(recommended_settings())
    plugins = cuda_plugins()
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    cuda = cuda_versions()
    figures = {
        "xla_flags": xla_flags.split(),
        "gpu_env_applied": applied,
        "gpu_env_detail": applied_detail,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "plugins": plugins,
        "python": platform.python_version(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "platform_version": device.client.platform_version,
        "compute_capability": capability,
        **cuda,
    }
    cuda_text = ", ".join(f"{name.replace('_', ' ')} {v}" for name, v in cuda.items())
    rows = [
        Row(
            "environment", "XLA_FLAGS", "info", f"{len(xla_flags.split())} flags" if xla_flags else "(unset)", xla_flags
        ),
        Row("environment", "launch/gpu_env.sh", "info", "applied" if applied else "not applied", applied_detail),
        Row(
            "environment",
            "versions",
            "info",
            f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
            f"{', '.join(plugins) or 'no CUDA plugin'}; python {platform.python_version()}",
        ),
        Row(
            "environment",
            "device",
            "info",
            device.device_kind,
            f"{jax.device_count()} device(s), {device.client.platform_version}"
            + (f", compute capability {capability}" if capability else ""),
        ),
        Row(
            "environment",
            "CUDA / cuDNN",
            "info",
            cuda_text or "n/a",
            "as loaded by jax" if cuda else "jax loaded no CUDA plugin",
        ),
    ]
    return rows, figures


def cuda_plugins() -> list[str]:
    """The installed jax CUDA plugins (jax-cuda13-plugin, jax-cuda12-pjrt, ...) with their versions."""
    return sorted(
        f"{d.metadata['Name']} {d.version}"
        for d in importlib.metadata.distributions()
        if re.fullmatch(r"jax[-_]cuda\d+[-_](plugin|pjrt)", d.metadata["Name"] or "", re.IGNORECASE)
    )


def nvidia_gpu() -> bool:
    """jax's default backend is CUDA (jax's own test for cuDNN's availability reads the same platform version)."""
    return jax.default_backend() == "gpu" and "cuda" in jax.devices()[0].client.platform_version.lower()


def no_gpu_reason() -> str | None:
    """Why there is no NVIDIA GPU to check, or None. Without a CUDA plugin the answer comes before jax starts a
    backend: starting one parses XLA_FLAGS, and an older jaxlib aborts on launch/gpu_env.sh's GPU flags even on a
    machine without a GPU, where this must print one line and succeed."""
    if not cuda_plugins():
        return "jax has no CUDA plugin installed: pip install -e '.[gpu]'"
    return None if nvidia_gpu() else f"jax backend: {jax.default_backend()}"
