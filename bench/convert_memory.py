"""Peak host memory of Hugging Face conversion, both ways, for a synthetic model of a few GB.

    .venv/bin/python bench/convert_memory.py [--layers 10] [--d-model 2048] [--ffn 8192] [--vocab 32768]
                                             [--devices 8] [--mesh mesh.fsdp=8] [--block-mb 64]
                                             [--steps import export] [--dir DIR] [--json out.json]

Writes a random Llama in float32 as a Hugging Face directory (safetensors files of at most 1 GiB with their
index, in --dir or a temporary directory; the default model is 3.05 GB), then runs three steps, each in a
fresh child process on --devices simulated CPU devices, and reads each child's peak RSS (ru_maxrss, from
os.wait4) when it ends:

    baseline   import JAX and llama-jax, make the mesh: what any llama-jax process holds
    import     hf.read_params onto the mesh: what `llama-jax convert hf:DIR OUT` (before it saves) and
               `llama-jax generate hf:DIR mesh.*` do
    export     params made on the mesh by a jitted random init (no host copy), then hf.write_hf: what
               `llama-jax convert RUN OUT` does once the checkpoint is restored

CPU devices are host memory: the params are in the RSS too. So each child also reports its RSS when the
measured part starts (JAX, the mesh, and for export the params already made), and "held" is what the peak
exceeds it by, less the params import creates. On GPUs the params are in device memory and the host holds
only what is held here: reading, a few blocks (hf.BLOCK_BYTES, 64 MiB); writing, the tensor being written
and a converted block (its copy on the devices, counted here, is device memory there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def model_config(args):
    from llama_jax.config import ModelConfig

    return ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=args.ffn,
        max_seq_len=4096,
        compute_dtype="float32",
    )


def write_random_model(directory: Path, args) -> tuple[int, int]:
    """A random float32 Hugging Face Llama in `directory`; (total bytes, largest tensor's bytes)."""
    import numpy as np

    from llama_jax.interop import hf, hf_config, hf_tensor_map

    cfg = model_config(args)
    shapes, target = {}, hf.single_device_target(cfg)
    for tensor in hf_tensor_map.tensor_map(cfg):
        ours = target
        for key in tensor.path:
            ours = ours[key]
        for i in range(cfg.n_layers) if tensor.per_layer else [None]:
            shapes[tensor.hf_name.format(i=i)] = tensor.hf_shape(ours.shape[1:] if tensor.per_layer else ours.shape)
    rng = np.random.default_rng(0)

    def blocks(shape):
        rows = max(1, 2**24 // max(1, int(np.prod(shape[1:]))))  # 64 MiB of float32 per block
        for start in range(0, shape[0], rows):
            yield (rng.standard_normal((min(rows, shape[0] - start), *shape[1:]), np.float32) * 0.02)

    directory.mkdir(parents=True, exist_ok=True)
    items = [(name, shape, lambda shape=shape: blocks(shape)) for name, shape in shapes.items()]
    hf.write_safetensors(directory, items, np.float32, shard_bytes=2**30)
    (directory / "config.json").write_text(json.dumps(hf_config.hf_config(cfg, "float32"), indent=2) + "\n")
    sizes = [int(np.prod(s)) * 4 for s in shapes.values()]
    return sum(sizes), max(sizes)


def child(step: str, directory: Path, args) -> None:
    """One measured step (runs in its own process); prints its timing and RSS figures as JSON."""
    import math
    import resource

    import jax
    import jax.numpy as jnp

    from llama_jax.checkpoint import specs
    from llama_jax.interop import hf

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def started() -> dict:
        return {
            "start": time.perf_counter(),
            "rss_at_start_bytes": rss(),
            "peak_before_start_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    spec = specs.resolve(f"hf:{directory / 'hf'}")
    config = specs.inference_config(spec.model, args.mesh, batches=False)
    target = specs.param_target(config, specs.inference_mesh(config))
    figures = started()
    if step == "import":
        jax.block_until_ready(hf.read_params(spec.hf_dir, spec.model, target, block_bytes=args.block_mb * 2**20))
    elif step == "export":

        def init(t):  # made in its shards, one parameter at a time: no temporaries beyond the parameter
            values = jax.jit(
                lambda: 0.02 * jnp.sin(jax.lax.iota(jnp.float32, math.prod(t.shape)).reshape(t.shape)),
                out_shardings=t.sharding,
            )()
            return values.astype(t.dtype).block_until_ready()

        params = jax.tree.map(init, target)
        figures = started()
        hf.write_hf(directory / "exported", params, spec.model, block_bytes=args.block_mb * 2**20)
    figures["seconds"] = time.perf_counter() - figures.pop("start")
    print(json.dumps(figures))


def measure(step: str, directory: Path, args) -> dict:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=" ".join(
            f for f in (os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={args.devices}") if f
        ),
    )
    command = [
        sys.executable,
        __file__,
        "--child",
        step,
        "--dir",
        str(directory),
        *_model_args(args),
        "--devices",
        str(args.devices),
        "--block-mb",
        str(args.block_mb),
        "--mesh",
        *args.mesh,
    ]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"the {step} step failed with status {proc.returncode}")
    return {"peak_rss_bytes": usage.ru_maxrss * 1024, **json.loads(out.strip().splitlines()[-1])}


def _model_args(args) -> list[str]:
    return [
        "--layers",
        str(args.layers),
        "--d-model",
        str(args.d_model),
        "--ffn",
        str(args.ffn),
        "--vocab",
        str(args.vocab),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--mesh", nargs="*", default=["mesh.fsdp=8"], help="mesh.* keys (default mesh.fsdp=8)")
    parser.add_argument(
        "--dir",
        help="work directory, kept (default: a temporary one, removed at the end); a model "
        "written there by an earlier run with the same sizes is used again",
    )
    parser.add_argument(
        "--block-mb", type=int, default=64, help="conversion block size in MiB (default 64: hf.BLOCK_BYTES)"
    )
    parser.add_argument("--steps", nargs="+", default=["import", "export"], choices=("import", "export"))
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--child", choices=("baseline", "import", "export"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, Path(args.dir), args)
        return

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="convert_memory_"))
    try:
        start = time.perf_counter()
        sizes = work / "hf" / "sizes.json"
        if not sizes.is_file() or json.loads(sizes.read_text())["args"] != _model_args(args):
            shutil.rmtree(work / "hf", ignore_errors=True)
            total, largest = write_random_model(work / "hf", args)
            sizes.write_text(json.dumps({"args": _model_args(args), "total": total, "largest": largest}))
        total, largest = (json.loads(sizes.read_text())[k] for k in ("total", "largest"))
        print(
            f"model: {args.layers} layers, d_model {args.d_model}, ffn {args.ffn}, vocab {args.vocab}: "
            f"{total / 1e9:.2f} GB of float32, largest tensor {largest / 1e6:.0f} MB "
            f"({time.perf_counter() - start:.0f}s to write); {args.devices} CPU devices, {' '.join(args.mesh)}"
        )
        results = {"model_bytes": total, "largest_tensor_bytes": largest, "devices": args.devices, "mesh": args.mesh}
        for step in ("baseline", *args.steps):
            shutil.rmtree(work / "exported", ignore_errors=True)
            results[step] = figures = measure(step, work, args)
            peak, at_start = figures["peak_rss_bytes"], figures["rss_at_start_bytes"]
            line = f"{step:>8}: peak RSS {peak / 1e9:5.2f} GB"
            if step != "baseline":
                # import creates the params (in the RSS on CPU devices); export starts with them
                held = peak - at_start - (total if step == "import" else 0)
                figures["held_bytes"] = held
                line += (
                    f", {at_start / 1e9:.2f} GB at the start{' + the model' if step == 'import' else ''}"
                    f" + {held / 1e6:.0f} MB held by the conversion ({held / largest:.2f}x the largest "
                    f"tensor), {figures['seconds']:.0f}s; peak before it "
                    f"{figures['peak_before_start_bytes'] / 1e9:.2f} GB"
                )
            print(line, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
