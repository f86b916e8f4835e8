"""Make tests/golden/xla_gpu_flags.json: the XLA flags that a CUDA jaxlib plugin knows, and the ones it marks
as deprecated aliases, read from the plugin's binary (XLA registers every flag under its name as a string;
no GPU is needed to read them).

    python -m pip download --no-deps jax-cuda13-pjrt==0.12.0 -d /tmp/wheels
    python tests/golden/make_xla_gpu_flags.py /tmp/wheels/jax_cuda13_pjrt-0.12.0-*.whl > tests/golden/xla_gpu_flags.json

tests/test_launch.py checks every flag launch/gpu_env.sh sets against this file, and against the installed
CUDA plugin when there is one (with the same functions).
"""

import json
import re
import sys
import zipfile
from pathlib import Path

FLAG = re.compile(rb"(?<![A-Za-z0-9_])xla_[a-z0-9_]+(?![A-Za-z0-9_])")
# XLA's help text of a deprecated boolean alias: "[Deprecated] True maps to --xla_gpu_pipeline_all_gather=on ...".
# The help does not name the alias itself; XLA 0.11-0.12 names them xla_gpu_enable_pipelined_<collective>.
DEPRECATED_ALIAS = re.compile(rb"\[Deprecated\] True maps to --(xla_gpu_pipeline_([a-z_]+))=on")


def plugin_binary(path: Path) -> bytes:
    """The XLA plugin shared object: a .so file itself, or the one inside a jax-cuda*-pjrt wheel."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            name = next(n for n in wheel.namelist() if n.endswith("xla_cuda_plugin.so"))
            return wheel.read(name)
    return path.read_bytes()


def known_flags(binary: bytes) -> dict:
    """{"flags": every xla_* name in the binary (flags and a few other identifiers: a superset of the flags),
    "deprecated": {alias: the flag it maps to}}."""
    deprecated = {
        f"xla_gpu_enable_pipelined_{m.group(2).decode()}": m.group(1).decode()
        for m in DEPRECATED_ALIAS.finditer(binary)
    }
    return {"flags": sorted({m.group().decode() for m in FLAG.finditer(binary)}), "deprecated": deprecated}


if __name__ == "__main__":
    wheel = Path(sys.argv[1])
    print(json.dumps({"source": wheel.name, **known_flags(plugin_binary(wheel))}, indent=0))
