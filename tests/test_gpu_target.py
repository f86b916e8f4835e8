"""Compiling for GPUs that are not here (perf/gpu_target.py): XLA:GPU's own compile of the train step for an H100
cluster on this CPU machine, as `llama-jax plan|tune --target h100 --gpus N` runs it.

The compiles need jax's CUDA plugin (the gpu extra: Python >= 3.12); elsewhere those tests skip, and what can be
checked without it (the target config written from the data sheets, launch/gpu_env.sh's flags as compile
options, cuDNN's workspace, the one-line refusal without the plugin) runs everywhere. Each compile takes ~10 s:
one per test at most, on tiny models.
"""

import dataclasses
import json
import math
import re

import pytest
from test_bench import load_script
from test_cuda_lowering import square_tensors
from test_launch import gpu_env_xla_flags
from test_readme import llama_jax_args, readme_commands

from llama_jax import cli
from llama_jax.config import load_config
from llama_jax.distributed import sharding
from llama_jax.model import projection
from llama_jax.perf import costmodel, gpu_target, hardware, hlo
from llama_jax.planning import plan as planning
from llama_jax.planning import tune, tune_report
from llama_jax.training.memory import cudnn_workspace_bytes, memory_budget, memory_bytes
from llama_jax.training.program import TrainProgram

SEQ = 512
NO_PLUGIN = gpu_target.plugin_missing()
needs_plugin = pytest.mark.skipif(NO_PLUGIN is not None, reason=f"XLA:GPU cannot compile here: {NO_PLUGIN}")


# A tiny bf16 model whose attention runs on cuDNN (head_dim 32), one 512-token sequence per GPU of 8.
GPU_MODEL = [
    "model.d_model=128",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.n_layers=2",
    "model.ffn_dim=256",
    "model.compute_dtype=bfloat16",
    f"model.max_seq_len={SEQ}",
    f"train.seq_len={SEQ}",
    "train.batch_size=8",
    "train.microbatches=1",
]


def gpu_config(*overrides: str):
    return load_config("tiny", [*GPU_MODEL, *overrides])


# --------------------------------------------------------------------------------------------
# Without the plugin too


def test_the_compile_options_are_launch_gpu_env_sh_flags():
    """gpu_env.sh is the one list a GPU run starts with; the planned compile takes the same flags, typed as XLA's
    compile options want them (bools, integers, the pipelining enum by name)."""
    assert " ".join(gpu_target.GPU_ENV_FLAGS) == gpu_env_xla_flags()
    options = gpu_target.compiler_options()
    assert options["xla_gpu_enable_triton_gemm"] is False and options["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert options["xla_gpu_all_gather_combine_threshold_bytes"] == 134217728
    assert options["xla_gpu_pipeline_all_gather"] == "COLLECTIVE_PIPELINING_MODE_ON"
    assert options["xla_disable_hlo_passes"] == "rematerialization" and options["xla_gpu_enable_command_buffer"] == ""
    assert options["xla_gpu_autotune_level"] == 0  # nothing to time without the GPU


@pytest.mark.parametrize("target", sorted(gpu_target.TARGETS))
def test_the_target_config_is_written_from_the_data_sheet_table(target):
    spec = gpu_target.spec(target)
    text = gpu_target.target_config(target)
    fields = dict(re.findall(r"^\s*(\w+): (.+)$", text, flags=re.MULTILINE))
    assert int(fields["core_count"]) == spec.sms
    assert int(fields["device_memory_size"]) == int(spec.memory_gib * 2**30)
    assert int(fields["memory_bandwidth"]) == hardware.table_bandwidth(spec.name)[0]
    assert int(fields["l2_cache_size"]) == int(spec.l2_mib * 2**20)
    assert float(fields["clock_rate_ghz"]) == spec.boost_ghz
    assert f"cuda_compute_capability {{ major: {spec.compute_capability.replace('.', ' minor: ')} }}" in text
    assert fields["device_description_str"] == f'"{spec.name}"'
    # The device kind XLA reports names the same table row that peaks, bandwidth and the budget come from.
    assert hardware.table_peak_flops(spec.name, "bfloat16") > 0
    assert gpu_target.traced_gpu(spec.name).cudnn_version == 91900  # cuDNN 9.19, as jax reports it


def test_cudnn_workspace_is_the_measured_eight_bytes_per_document_head_token_and_dim():
    """8 bytes x documents x q's elements: 4 GiB for one 8K row of Llama 3 8B's 32 heads at 16 documents, 0.25 GiB
    per document, as an H100 measured (docs/performance.md); the largest call of the program counts."""

    def call(q: str, extra: str = "") -> str:
        return (
            f"  %fmha = (bf16[{q}]{{3,1,2,0}}, u8[0]{{0}}) custom-call(%q, %k, %v{', %s, %s' if extra else ''}), "
            f'custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={{bf16[{q}]{{3,2,1,0}}, '
            f"bf16[1,8192,8,128]{{3,2,1,0}}, bf16[1,8192,8,128]{{3,2,1,0}}{extra}}}, api_version=X"
        )

    packed = call("1,8192,32,128", ", s32[1,16]{1,0}, s32[1,17]{1,0}")
    assert gpu_target.cudnn_workspace_bytes(packed) == 4 * 2**30
    assert gpu_target.cudnn_workspace_bytes(call("1,8192,32,128")) == 2**28  # one document per row
    assert gpu_target.cudnn_workspace_bytes(call("2,8192,32,128") + "\n" + call("1,8192,32,128")) == 2**29
    assert gpu_target.cudnn_workspace_bytes("%d = bf16[8] add(%a, %b)") == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "8"], "--gpus and --gpus-per-host plan a cluster of --target GPUs, e.g. --target h100 --gpus 32"),
        (["--target", "h100"], "--target h100 needs --gpus N: how many GPUs the run has"),
        (["--target", "h900", "--gpus", "8"], "--target h900: unknown GPU; use one of h100, h200, a100, b200"),
        (
            ["--target", "h100", "--gpus", "12", "--gpus-per-host", "8"],
            "--gpus 12 --gpus-per-host 8: the GPUs must fill whole hosts "
            "(--gpus a positive multiple of --gpus-per-host)",
        ),
        (
            ["--target", "h100", "--gpus", "8", "--devices-per-host", "4"],
            "--devices-per-host is for simulated devices; with --target the hosts are --gpus-per-host",
        ),
    ],
)
def test_bad_target_options_are_one_line_and_exit_2(args, message, capsys):
    assert cli.main(["plan", "tiny", *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"llama-jax: error: {message}"]


def test_target_without_the_cuda_plugin_is_one_line_and_exit_2(monkeypatch, capsys):
    """Python 3.11's jax has no CUDA plugin: --target says what to install. Where the plugin is installed it is
    hidden here, so both interpreters check the same line."""
    if NO_PLUGIN is None:
        import importlib.util

        find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: None if name.startswith("jax_plugins") else find_spec(name, *a),
        )
    for command in ("plan", "tune"):
        assert cli.main([command, "tiny", "--target", "h100", "--gpus", "8"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert (
            line.startswith("llama-jax: error: --target compiles the step with XLA:GPU, which needs jax's CUDA plugin")
            and "pip install -e '.[gpu]' (Python >= 3.12, jax >= 0.11.1)" in line
        )


# --------------------------------------------------------------------------------------------
# XLA:GPU's compile (the CUDA plugin)


@pytest.fixture(scope="module")
def eight_h100s():
    """The train step compiled by XLA:GPU for one host of 8 H100s, fsdp=8 (one sequence per GPU)."""
    config = gpu_config("mesh.fsdp=8")
    program = TrainProgram.build(config, sharding.make_mesh(config, gpu_target.devices("h100", 8)))
    return program, program.compile_step().as_text()


@needs_plugin
def test_the_step_compiles_to_cublas_gemms_and_cudnn_attention_without_a_t_by_t_tensor(eight_h100s):
    """The kernels follow the mesh's GPUs, not this CPU: cuDNN attention forward and backward (the packed layout
    too), every matmul a cuBLASLt call under gpu_env.sh's flags (no Triton GEMM, no XLA dot left), and no
    [T, T] mask or score tensor anywhere in the optimized program."""
    _, text = eight_h100s
    calls = set(re.findall(r'custom_call_target="([^"]+)"', text))
    assert {"__cublas$lt$matmul", "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= calls
    assert not re.search(r"= \S+ dot\(", text) and "__triton_gemm" not in text
    assert square_tensors(text, SEQ) == []
    assert re.search(r"s32\[1,16\]", text)  # the packed layout's document lengths: Hopper's
    assert "num_partitions=8" in text.splitlines()[0]  # one program for the 8 GPUs


@needs_plugin
def test_the_step_fits_its_budget_with_cudnns_workspace_counted(eight_h100s):
    """Memory per GPU: XLA:GPU's arguments, temporaries and outputs plus cuDNN's workspace, which the compile does
    not size (8 bytes x 16 documents x q's 1 x 512 x 4 x 32 elements: 8 MiB). The budget is the H100's: 90% of
    80 GiB, as launch/gpu_env.sh lets XLA allocate. The step needs under 128 MiB."""
    program, _ = eight_h100s
    memory = program.compile_step().memory_analysis()
    workspace = cudnn_workspace_bytes(program)
    assert workspace == 8 * 16 * 1 * SEQ * 4 * 32
    assert memory_bytes(program) == (
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + workspace
    )
    assert memory_bytes(program) < 128 * 2**20
    assert memory_budget(program) == 0.9 * 80 * 2**30


@needs_plugin
def test_a_pipeline_plan_compiles_for_four_hosts_with_its_permutes_along_the_pipeline_axis():
    """pipeline=4 over 4 hosts of 8 GPUs (1x4x8), fsdp=8 within each: the stages hand activations on with
    collective permutes along the pipeline axis, between hosts; XLA:GPU's double buffering unrolls the stage loop
    by 2 and peels an iteration, and the plan still counts the schedule's M + P - 1 iterations."""
    config = gpu_config(
        "model.n_layers=4", "mesh.pipeline=4", "mesh.fsdp=8", "train.batch_size=64", "train.microbatches=8"
    )
    plan = planning.make_plan(config, sharding.make_mesh(config, gpu_target.devices("h100", 32)))
    assert plan.target.startswith("H100") and plan.hosts == 4 and plan.devices == 32
    permutes = [t for t in plan.collective_by_axis if t.kind == "collective-permute"]
    assert permutes and all("pipeline" in t.axes and t.tier == "inter-host" for t in permutes)
    assert plan.pipeline_iterations == 8 + 4 - 1 and plan.compiled_bubble == pytest.approx(plan.bubble)
    assert plan.cudnn_workspace_bytes > 0 and plan.total_bytes < plan.budget_bytes


# llama3_405b's long-context layout in small, on 8 hosts of 8 H100s: tensor=8 within a host, fsdp=4 x sequence=2
# across them, the parameters stored over fsdp and sequence (mesh.rules.embed); and the same step without context
# parallelism (fsdp=8), for comparison.
LONG_CONTEXT = [
    "model.max_seq_len=4096",
    "train.seq_len=4096",
    "model.d_model=512",
    "model.n_heads=8",
    "model.n_kv_heads=8",
    "model.ffn_dim=1024",
    "mesh.tensor=8",
    "train.batch_size=16",
    "remat.policy=full",
]


@pytest.fixture(scope="module")
def long_context_plans():
    """{layout: its plan} for 'context parallel' and 'fsdp'."""
    layouts = {
        "context parallel": [
            "mesh.fsdp=4",
            "mesh.sequence=2",
            "mesh.rules.embed=fsdp,sequence",
            "train.microbatches=4",
        ],
        "fsdp": ["mesh.fsdp=8", "mesh.sequence=1", "train.microbatches=2"],
    }
    plans = {}
    for layout, overrides in layouts.items():
        config = gpu_config(*LONG_CONTEXT, *overrides)
        plans[layout] = planning.make_plan(config, sharding.make_mesh(config, gpu_target.devices("h100", 64)))
    return plans


@needs_plugin
def test_weights_stored_over_the_sequence_axis_leave_the_partitioner_nothing_to_replicate(long_context_plans):
    """Read as llama.py reads them under context parallelism (context.read: gathered over fsdp and sequence), weights
    stored over `sequence` give XLA's partitioner nothing to replicate. Before, it warned of "involuntary full
    rematerialization" five times (the embedding lookup, the output projection, the layers' constraints) and the
    step moved 4.6x the analytic minimum between GPUs (1.6x now; 1.7x for the fsdp layout)."""
    plan = long_context_plans["context parallel"]
    assert plan.rematerialized == ()  # what XLA logged while compiling it (xla_log.py)
    assert plan.hosts == 8 and plan.collective_total < 2.5 * plan.minimum_total


@needs_plugin
def test_context_parallelism_is_priced_at_the_matmul_work_of_the_same_step_without_it(long_context_plans):
    """No device computes another's tokens (before, with fsdp > 1, XLA gathered the sequence to keep the weights
    split, and every device ran the projections on all of it), and each chunk's kernels are priced as one
    document per row runs them (plan.branch_runs: the prefix branch, not the three branches compiled;
    plan.work_shares: the prefix kernel at the keys it uses, not the whole gathered sequence). So the
    context-parallel step's HLO FLOPs are the fsdp step's: 1.303 x the model's FLOPs both (3.531 before)."""
    context_parallel, fsdp = long_context_plans["context parallel"], long_context_plans["fsdp"]
    assert context_parallel.model_flops == fsdp.model_flops
    assert context_parallel.hlo_flops == pytest.approx(fsdp.hlo_flops, rel=0.01)


@needs_plugin
def test_tune_ranks_candidates_compiled_for_the_target(tmp_path):
    """tune --target: candidates compiled by XLA:GPU for the planned GPUs, priced with the H100's data sheet and
    never measured (they are not here)."""
    gpus = tuple(gpu_target.devices("h100", 8))
    options = tune.Options(policies=("none",), microbatches=(1,), every_n_layers=(1,), devices=gpus, progress=False)
    pins = [
        "mesh.pipeline=1",
        "mesh.data=1",
        "mesh.fsdp=8",
        "mesh.tensor=1",
        "mesh.sequence=1",
        "train.microbatches=1",
        "remat.policy=none",
        f"data.cache_dir={tmp_path}",
    ]
    report = tune.tune("tiny", [*GPU_MODEL, *pins], options)
    assert not report.measured and report.devices == 8 and report.device_kind == "NVIDIA H100 80GB HBM3"
    assert report.model.peak_flops == 989e12 and report.model.memory_bandwidth == 3350e9
    assert report.winner.memory_bytes > 0 and report.winner.predicted_s > 0
    tune_report.write_winner(report, tmp_path / "tune.yaml")
    assert "for 8 NVIDIA H100 80GB HBM3 device(s)" in (tmp_path / "tune.yaml").read_text()


@pytest.fixture(scope="module")
def one_h100_fp8_and_bf16():
    """The step compiled by XLA:GPU for one H100 with model.fp8=tensorwise and without (remat off, so that each
    projection's matmuls run once: forward, input gradient, weight gradient): (config, {recipe: HLO text})."""
    texts = {}
    for recipe in ("tensorwise", "none"):
        config = gpu_config("mesh.fsdp=1", "train.batch_size=1", "remat.policy=none", f"model.fp8={recipe}")
        program = TrainProgram.build(config, sharding.make_mesh(config, gpu_target.devices("h100", 1)))
        texts[recipe] = program.compile_step().as_text()
    return config, texts


def projection_flops(config) -> float:
    """Per step: forward, input-gradient and weight-gradient matmuls of the 7 projections of every layer."""
    m, tokens = config.model, config.train.batch_size * config.train.seq_len
    d, q, kv = m.d_model, m.n_heads * m.resolved_head_dim, m.n_kv_heads * m.resolved_head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * m.ffn_dim  # q, k, v, o; gate, up, down
    return 3 * 2 * tokens * per_layer * m.n_layers


def gemm_flops(operands: tuple[str, ...], result: str) -> float:
    """2 x output x contracted elements of a 2-D GEMM, [M, K] x [K, N] in any layout: K^2 = |lhs| |rhs| / |out|."""
    size = lambda shape: math.prod(int(d) for d in re.findall(r"\d+", shape.split("[")[1].split("]")[0]))  # noqa
    out = size(result.strip("("))
    return 2.0 * out * math.isqrt(size(operands[0]) * size(operands[1]) // out)


@needs_plugin
def test_the_fp8_step_runs_every_projection_on_cublaslts_fp8_gemm_and_nothing_else(one_h100_fp8_and_bf16):
    """XLA:GPU rewrites each scaled fp8 dot of projection.py into cuBLASLt's fp8 GEMM (projections that share an
    input, q/k/v and gate/up, into one): the forward (e4m3 x e4m3), input-gradient (e5m2 x e4m3) and
    weight-gradient (e4m3 x e5m2) GEMMs of every layer, a third of the projections' FLOPs each, each writing bf16
    with the scales applied, and every projection FLOP of the step is an fp8 one. The output projection and loss
    (the [d, vocab] GEMMs) and attention (cuDNN's and XLA's, on bf16) keep their types: the two steps' matmul FLOPs
    are the same."""
    config, texts = one_h100_fp8_and_bf16
    fp8, bf16 = (hlo.analyze(texts[r], 1) for r in ("tensorwise", "none"))
    assert fp8.fp8_flops == projection_flops(config) and bf16.fp8_flops == 0
    assert fp8.dot_flops == bf16.dot_flops  # the same matmuls, in other types
    calls = [
        (target, operands, result)
        for target, operands, result in hlo.custom_calls(texts["tensorwise"])
        if target.startswith(("__cublas", "__cudnn"))
    ]
    f8 = [
        (tuple(o.split("[")[0] for o in operands[:2]), operands, result)
        for target, operands, result in calls
        if target == "__cublas$lt$matmul$f8"
    ]
    per_kind = {}
    for kinds, operands, result in f8:
        per_kind[kinds] = per_kind.get(kinds, 0.0) + gemm_flops(operands, result)
        # The scaled product is written in the compute dtype by the GEMM itself, not in fp32 for a pass to cast.
        assert result.strip("(").startswith("bf16["), result
    assert per_kind == pytest.approx(
        {
            ("f8e4m3fn", "f8e4m3fn"): projection_flops(config) / 3,  # forward
            ("f8e5m2", "f8e4m3fn"): projection_flops(config) / 3,  # input gradient
            ("f8e4m3fn", "f8e5m2"): projection_flops(config) / 3,
        }
    )  # weight gradient
    others = [(target, " ".join(operands)) for target, operands, _ in calls if target != "__cublas$lt$matmul$f8"]
    assert not any("f8" in operands for _, operands in others)
    vocab = f",{config.model.vocab_size}]"  # the output projection's [d, vocab] kernel, its logits and gradients
    assert sum(vocab in operands for t, operands in others if t.startswith("__cublas")) == 3
    assert not any(vocab in " ".join(operands) for _, operands, _ in f8)
    assert any(t.startswith("__cudnn$fmha") for t, _ in others)  # attention: cuDNN's, on bf16


@needs_plugin
def test_the_cost_model_prices_the_fp8_steps_projections_at_the_fp8_peak(one_h100_fp8_and_bf16):
    """On the H100's data sheet, with memory out of the way: the fp8 step's predicted compute time is the bf16
    step's less half of the fp8 FLOPs' share (1,979 TFLOP/s against 989), from each compiled step's operations."""
    config, texts = one_h100_fp8_and_bf16
    h100 = costmodel.data_sheet_cost_model("bfloat16", gpu_target.spec("h100").name)
    assert (h100.peak_flops, h100.fp8_peak_flops) == (989e12, 1979e12)
    compute_only = dataclasses.replace(h100, memory_bandwidth=math.inf)
    fp8, bf16 = (hlo.analyze(texts[r], 1) for r in ("tensorwise", "none"))
    share = fp8.fp8_flops / fp8.dot_flops
    assert share == projection_flops(config) / bf16.dot_flops  # attention's bf16 matmuls are most of this tiny step
    ratio = compute_only.compute_seconds(fp8.operations) / compute_only.compute_seconds(bf16.operations)
    assert ratio == pytest.approx(1 - share * (1 - 989 / 1979))
    # With memory traffic priced too the fp8 step is still predicted faster, if by less.
    assert h100.compute_seconds(fp8.operations) < h100.compute_seconds(bf16.operations)


@needs_plugin
def test_plan_prices_cudnns_one_document_kernel_not_the_fallbacks_it_compiles_beside_it(eight_h100s):
    """cuDNN attention's kernel choice (cudnn.py) compiles the exact fallback for rows of too many documents into
    every step; plan's FLOPs and traffic count only the branch a step of one document per row takes. Counting every
    branch, the 8B-shaped step's traffic was 4,453 GiB and its prediction 3x the measured step."""
    program, text = eight_h100s
    every_branch, priced = hlo.analyze(text, 8), hlo.analyze(text, 8, planning.branch_runs(program))
    assert 0 < priced.dot_flops < every_branch.dot_flops and 0 < priced.memory_bytes < every_branch.memory_bytes
    assert any(target.startswith("__cudnn$fmha") for target, _, _ in hlo.custom_calls(text))


@needs_plugin
def test_the_prediction_bench_puts_plans_step_within_15_percent_of_a_measured_gpu_step(tmp_path):
    """bench/gpu_prediction.py (docs/performance.md runs it over every GPU step we have measured; its command is
    parsed in test_readme): plan --target's predicted step for the H200's fp8 step, the one with the most kinds of
    kernel (bf16 and fp8 GEMMs, cuDNN attention, fp8's quantisation), within 15% of the 0.484 s measured."""
    bench = load_script("gpu_prediction")
    assert bench.main(["--only", "h200-fp8", "--json", str(tmp_path / "rows.json")]) == 0
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert row["name"] == "h200-fp8" and row["step_s"] == 0.484 and row["target"].startswith("H200")
    assert abs(row["predicted_step_s"] / row["step_s"] - 1) <= 0.15
    # Measured when each fp8 GEMM wrote fp32 and a pass cast it; today's GEMMs write bf16: predicted faster.
    assert row["today_predicted_step_s"] < row["predicted_step_s"]


def test_the_body_bench_takes_the_marginal_layer_of_each_program_as_it_was(monkeypatch):
    """bench/gpu_prediction.py --body: per program, plan's step at 4 and 8 layers, the difference per layer, its MFU
    of the data sheet's bf16 peak, its speed-up on bf16's layer; the earlier fp8 program compiled as measured."""
    bench = load_script("gpu_prediction")
    today = projection._scaled_dot
    compiled = []

    def fake_plan(target, overrides):  # bf16: 0.1 s a layer; fp8 0.06 s, 0.05 s today; 1e14 model FLOPs a layer
        layers = int(overrides[-1].split("=")[1])
        fp8 = "model.fp8=tensorwise" in overrides
        per_layer = (0.05 if projection._scaled_dot is today else 0.06) if fp8 else 0.1
        compiled.append((fp8, projection._scaled_dot is today, layers))
        return dataclasses.make_dataclass("Plan", ["predicted_step_s", "model_flops"])(
            0.2 + per_layer * layers, 1e14 * layers
        )

    monkeypatch.setattr(bench, "_plan", fake_plan)
    rows = bench.predicted_body("h200")
    assert compiled == [
        (False, True, 4),
        (False, True, 8),
        (True, False, 4),
        (True, False, 8),
        (True, True, 4),
        (True, True, 8),
    ]
    assert projection._scaled_dot is today  # the earlier program's stand-in is undone
    assert [r["layer_s"] for r in rows] == pytest.approx([0.1, 0.06, 0.05])
    assert [r["layer_mfu"] for r in rows] == pytest.approx(
        [1e14 / 0.1 / 989e12, 1e14 / 0.06 / 989e12, 1e14 / 0.05 / 989e12]
    )
    assert [r["speedup_on_layers"] for r in rows] == pytest.approx([1, 0.1 / 0.06, 2])


# --------------------------------------------------------------------------------------------
# The documented commands


def target_commands() -> list[str]:
    return [c for c in readme_commands("llama-jax ") if "--target " in c]


# jax writes a compile-only executable to the session's persistent compilation cache but cannot load it back (no
# GPU client): a documented command that compiles the same program as an earlier one warns, then compiles.
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
@pytest.mark.parametrize("command", target_commands())
def test_readme_target_commands_compile_for_the_gpus_or_say_what_is_missing(command, capsys):
    """Each documented --target command: where the plugin is, a plan compiles for the GPUs it names (with 2 of
    the model's layers and one sequence per GPU, so that a test can afford it) and a tune lists its candidates
    (--dry-run); without the plugin, it answers in one line and exit 2."""
    args = llama_jax_args(command)
    assert args[0] in ("plan", "tune")
    if args[0] == "tune":
        args = [*args, "--dry-run"]
    elif NO_PLUGIN is None:  # key=value before the options, as `plan` takes them
        first_option = next(i for i, a in enumerate(args) if a.startswith("--"))
        # One stage of a staged preset (docs/recipe.md; every stage's plan: test_readme's plan commands).
        affordable = ["model.n_layers=2", f"train.batch_size={args[args.index('--gpus') + 1]}", "train.stages=[]"]
        args[first_option:first_option] = affordable
    status = cli.main(args)
    out, err = capsys.readouterr()
    if NO_PLUGIN is not None:
        assert status == 2 and err.strip().splitlines() == [f"llama-jax: error: {NO_PLUGIN}"]
        return
    assert status == 0, err
    if args[0] == "plan":
        report = json.loads(out) if "--json" in args else None
        assert report and report["target"].startswith(args[args.index("--target") + 1].upper())
        assert report["devices"] == int(args[args.index("--gpus") + 1]) and report["hlo_flops"] > 0
        assert report["cudnn_workspace_bytes"] > 0 and report["total_bytes"] <= report["budget_bytes"]
        # On the GPU's data sheet: a predicted step time and its MFU; with fp8 projections, against the fp8 peak too
        assert report["predicted_step_s"] > 0 and 0 < report["predicted_mfu"] < 1
        fp8 = "model.fp8=tensorwise" in args
        assert (report["fp8_flops"] > 0) == fp8 and (report["predicted_mfu_fp8"] is not None) == fp8
        if fp8:
            assert report["predicted_mfu_fp8"] == pytest.approx(report["predicted_mfu"] * 989 / 1979)
    else:
        assert re.search(r"\d+ candidates: \d+ valid", out.strip().splitlines()[-1])
