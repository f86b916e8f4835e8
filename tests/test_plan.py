"""`llama-jax plan`: ahead-of-time memory, FLOPs and communication of the train step."""

import dataclasses
import json
import os

import pytest
from conftest import TINY_MODEL, tiny_config

from llama_jax import cli
from llama_jax.distributed import sharding
from llama_jax.perf import xla_log
from llama_jax.planning.plan import collective_minimum, make_plan
from llama_jax.planning.plan_report import format_plan

MODEL = dataclasses.asdict(dataclasses.replace(TINY_MODEL, n_heads=8, n_kv_heads=2))


def plan_for(**mesh):
    cfg = tiny_config(model=MODEL, mesh=dict(data=1, fsdp=1, tensor=1, sequence=1) | mesh)
    return make_plan(cfg, sharding.make_mesh(cfg))


@pytest.fixture(scope="module")
def fsdp_plan():
    return plan_for(fsdp=8)


def test_hlo_flops_count_every_layer_and_equal_model_flops_without_recomputation(fsdp_plan):
    # XLA's own cost analysis would count the scanned layer once; the matmuls of the compiled
    # program, every layer counted, are exactly the model FLOPs when nothing is recomputed.
    assert fsdp_plan.hlo_flops == pytest.approx(fsdp_plan.model_flops, rel=0.02)


def test_full_recomputation_shows_up_as_extra_hlo_flops():
    cfg = tiny_config(model=MODEL, remat=dict(policy="full"), mesh=dict(data=1, fsdp=8, tensor=1, sequence=1))
    plan = make_plan(cfg, sharding.make_mesh(cfg))
    assert 1.15 < plan.hlo_flops / plan.model_flops < 1.5  # about one extra forward of the layers


def test_an_fp8_plan_counts_its_fp8_flops_and_predicts_no_speed_without_a_data_sheet(fsdp_plan):
    """model.fp8=tensorwise on CPU devices: the plan has an fp8 line (what XLA:CPU made of the fp8 matmuls), and
    neither plan has a predicted step time or MFU: a CPU has no data sheet (no fp8 peak either)."""
    from llama_jax.planning.plan_report import format_plan

    cfg = tiny_config(model=MODEL | {"fp8": "tensorwise"}, mesh=dict(data=1, fsdp=8, tensor=1, sequence=1))
    plan = make_plan(cfg, sharding.make_mesh(cfg))
    assert plan.fp8 == "tensorwise" and plan.hlo_flops == pytest.approx(fsdp_plan.hlo_flops, rel=0.01)
    (line,) = [line for line in format_plan(plan).splitlines() if line.startswith("  fp8 ")]
    assert "of HLO: matmuls with fp8 operands, model.fp8=tensorwise" in line
    assert "  fp8 " not in format_plan(fsdp_plan) and fsdp_plan.fp8_flops == 0
    for p in (plan, fsdp_plan):
        assert p.predicted_step_s is p.predicted_mfu is p.predicted_mfu_fp8 is None
        assert "predicted step" not in format_plan(p)


def test_memory_fields_are_consistent(fsdp_plan):
    p = fsdp_plan
    assert p.argument_bytes > 0 and p.temporary_bytes > 0
    assert p.total_bytes == p.argument_bytes + p.temporary_bytes + p.output_bytes


def test_fsdp_gathers_weights(fsdp_plan):
    assert fsdp_plan.collective_bytes["all-gather"] > 0
    assert fsdp_plan.collective_minimum["fsdp"] > 0 and fsdp_plan.collective_minimum["tensor"] == 0


def test_data_parallel_traffic_is_the_gradient_all_reduce():
    plan = plan_for(data=8)
    assert plan.collective_bytes["all-gather"] == 0
    assert plan.collective_total == pytest.approx(plan.minimum_total, rel=0.1)


def test_context_parallel_traffic_matches_the_analytic_minimum():
    plan = plan_for(sequence=8)
    assert plan.collective_bytes["all-gather"] > 0 and plan.collective_bytes["reduce-scatter"] > 0
    assert plan.collective_total == pytest.approx(plan.minimum_total, rel=0.1)


def test_sequence_parallelism_lowers_activation_memory():
    with_sp = plan_for(tensor=8, sequence_parallel=True)
    without = plan_for(tensor=8, sequence_parallel=False)
    assert with_sp.temporary_bytes < without.temporary_bytes


def test_analytic_minimum_formulas():
    cfg = tiny_config(model=MODEL)
    nothing = collective_minimum(cfg, {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1})
    assert all(v == 0 for v in nothing.values())
    data = collective_minimum(cfg, {"data": 8, "fsdp": 1, "tensor": 1, "sequence": 1})
    from llama_jax.model.llama import param_count

    assert data["data"] == pytest.approx(2 * 7 / 8 * param_count(cfg.model) * 4)


def test_plan_command_prints_json(tmp_path, capsys):
    assert cli.main(["plan", "tiny", "model.n_layers=2", "mesh.fsdp=8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in (
        "argument_bytes",
        "temporary_bytes",
        "total_bytes",
        "hlo_flops",
        "model_flops",
        "collective_bytes",
        "collective_minimum",
    ):
        assert key in report
    assert set(report["collective_bytes"]) == {
        "all-gather",
        "reduce-scatter",
        "all-reduce",
        "all-to-all",
        "collective-permute",
    }


def test_plan_command_rejects_a_bad_mesh(capsys):
    assert cli.main(["plan", "tiny", "mesh.fsdp=3", "mesh.data=1"]) == 2
    assert "needs 3 devices" in capsys.readouterr().err


def test_vocab_parallel_loss_never_gathers_the_full_vocabulary():
    """With the vocab split over tensor, no collective carries a tensor whose last axis is the whole vocab."""
    import jax

    from llama_jax.training.batches import abstract_batch
    from llama_jax.training.program import TrainProgram

    cfg = tiny_config(model=MODEL, mesh=dict(data=1, fsdp=4, tensor=2, sequence=1))
    program = TrainProgram.for_config(cfg)
    with program.activate():
        text = program.train_step.lower(program.abstract_state(), abstract_batch(program)).compile().as_text()
    vocab = cfg.model.vocab_size
    collectives = [
        line
        for line in text.splitlines()
        if any(f" {kind}(" in line for kind in ("all-gather", "all-reduce", "reduce-scatter"))
    ]
    assert collectives and jax.device_count() == 8
    # The embedding/lm_head weights' own gradient all-reduce is [vocab/2, embed]; logits would be [.., vocab].
    assert not [line for line in collectives if f",{vocab}]" in line.split("=")[1].split("(")[0]]


def test_selective_recomputes_only_the_attention_core():
    """selective's extra HLO FLOPs are the attention core's forward, q·kᵀ and p·v of every layer:
    4·b·s²·heads·head_dim·layers; full recomputes much more."""

    def remat_plan(policy):
        cfg = tiny_config(model=MODEL, remat=dict(policy=policy), mesh=dict(data=1, fsdp=8, tensor=1, sequence=1))
        return make_plan(cfg, sharding.make_mesh(cfg))

    plans = {policy: remat_plan(policy) for policy in ("none", "selective", "full")}
    cfg = tiny_config(model=MODEL)
    m, t = cfg.model, cfg.train
    core = 4 * t.batch_size * t.seq_len**2 * m.n_heads * m.resolved_head_dim * m.n_layers
    extra = plans["selective"].hlo_flops - plans["none"].hlo_flops
    assert extra == pytest.approx(core, rel=0.1)
    assert plans["full"].hlo_flops - plans["none"].hlo_flops > 3 * extra
    assert plans["full"].temporary_bytes < plans["selective"].temporary_bytes < plans["none"].temporary_bytes


def test_compare_remat_plans_policies_that_run_alike_on_these_devices_once(monkeypatch):
    """Without pinned host memory (a CPU) an offload policy saves on the device: it shares its twin's plan."""
    import types

    from llama_jax.config.choices import REMAT_POLICIES
    from llama_jax.model import remat
    from llama_jax.planning import plan

    compiled, lines = [], []
    monkeypatch.setattr(
        plan,
        "make_plan",
        lambda config, mesh, devices_per_host=0: (
            compiled.append(config.remat.policy) or types.SimpleNamespace(compile_seconds=1.0)
        ),
    )
    plans = plan.compare_remat(tiny_config(), mesh=None, print_fn=lines.append)
    assert list(plans) == list(REMAT_POLICIES)
    assert compiled == [p for p in REMAT_POLICIES if p not in ("minimal_offload", "qkv_proj_offload")]
    assert plans["minimal_offload"] is plans["minimal"] and plans["qkv_proj_offload"] is plans["save_qkv_proj"]
    assert "remat.policy=minimal_offload runs like minimal on these devices: same plan" in lines
    offloading = remat.placement(tiny_config(remat=dict(policy="minimal_offload")).remat, offload=True)
    assert offloading[1] and offloading != remat.placement(tiny_config(remat=dict(policy="minimal")).remat, True)


# --------------------------------------------------------------------------------------------
# Collective bytes by mesh axis and link tier


@pytest.fixture(scope="module")
def two_host_plan():
    """fsdp=4 x tensor=2 on 2 planned hosts of 4 devices: fsdp crosses hosts, tensor stays inside."""
    cfg = tiny_config(model=MODEL, mesh=dict(data=1, fsdp=4, tensor=2, sequence=1))
    return make_plan(cfg, sharding.make_mesh(cfg), devices_per_host=4)


def test_bytes_by_axis_add_up_to_the_bytes_by_kind(two_host_plan):
    p = two_host_plan
    assert p.hosts == 2 and p.collective_by_axis
    for kind, total in p.collective_bytes.items():
        assert sum(t.bytes for t in p.collective_by_axis if t.kind == kind) == pytest.approx(total)
    assert sum(p.collective_tiers.values()) == pytest.approx(p.collective_total)
    # Weights are gathered over fsdp; the activations' tensor-parallel reductions run over tensor.
    assert {t.axes for t in p.collective_by_axis if t.kind == "all-gather"} >= {("fsdp",)}
    assert {t.axes for t in p.collective_by_axis if t.kind == "all-reduce"} >= {("tensor",)}
    for t in p.collective_by_axis:
        assert set(t.axes) <= {"fsdp", "tensor"} and t.bytes > 0
        assert t.tier == ("inter-host" if "fsdp" in t.axes else "intra-host"), t


def test_plan_prints_and_writes_bytes_by_axis_and_tier(two_host_plan, capsys):
    from llama_jax.planning import plan_report as planning

    text = planning.format_plan(two_host_plan)
    assert "on 8 device(s) in 2 host(s)" in text
    rows = text.split("collectives by the mesh axes their device groups span, per device per step:")[1].splitlines()
    assert rows[1].split() == ["axes", "kind", "tier", "bytes"]
    assert len(rows) == 2 + len(two_host_plan.collective_by_axis) + 1  # heading, header, rows, total
    assert any(r.split()[:3] == ["fsdp", "all-gather", "inter-host"] for r in rows)
    report = json.loads(planning.plan_json(two_host_plan))
    assert report["hosts"] == 2
    assert report["collective_by_axis"] == [
        {"axes": list(t.axes), "kind": t.kind, "tier": t.tier, "bytes": t.bytes}
        for t in two_host_plan.collective_by_axis
    ]
    assert report["collective_tiers"] == pytest.approx(two_host_plan.collective_tiers)


def test_one_process_plans_one_host(capsys):
    assert cli.main(["plan", "tiny", "model.n_layers=2", "mesh.fsdp=4", "mesh.tensor=2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["hosts"] == 1 and report["collective_tiers"]["inter-host"] == 0
    assert sum(row["bytes"] for row in report["collective_by_axis"]) == pytest.approx(report["collective_total"])


def test_devices_per_host_that_does_not_divide_the_devices_exits_2(capsys):
    assert cli.main(["plan", "tiny", "mesh.fsdp=8", "--devices-per-host", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "llama-jax: error: --devices-per-host 3 does not divide the 8 devices into hosts; use one of 1, 2, 4, 8"
    ]


# One of XLA's warnings as it logs them, from the long-context layout before context.read (a9fc992), shortened.
REMATERIALIZATION = (
    "W1128 12:02:17.789051    3328 spmd_partitioner.cc:666] [SPMD] Involuntary full rematerialization. The compiler "
    "cannot go from sharding {devices=[4,16,1]<=[64]} to {devices=[1,1,8,8]<=[64] last_tile_dim_replicate} "
    "efficiently for HLO operation %sharding_constraint.37 = bf16[1,256,512]{2,1,0} copy(%add_any.103), "
    'sharding={devices=[4,16,1]<=[64]}, metadata={op_name="jit(train_step)/while/body/eval_jaxpr/'
    'transpose(jvp(Llama))/while/body/eval_jaxpr/checkpoint/layers/sharding_constraint" stack_frame_id=465}. As the '
    "last resort, SPMD will replicate the tensor and then partition it to obtain the target sharding\n"
)
UNNAMED = (
    "W1128 12:03:37.298006    3641 spmd_partitioner.cc:666] [SPMD] Involuntary full rematerialization. The compiler "
    "cannot go from sharding {devices=[4,16,1]<=[64]} to {devices=[1,1,8,8]<=[64] last_tile_dim_replicate} "
    "efficiently for HLO operation %fake_parameter.2 = bf16[1,256,512]{2,1,0} parameter(2), sharding={...}\n"
)


def test_what_xla_logs_while_a_plan_compiles_reaches_the_user_and_the_plan(fsdp_plan, capfd):
    """XLA logs from C++ to file descriptor 2: xla_log.captured reads it there, writes it on to stderr as it came,
    and the plan keeps the operations the partitioner replicated whole; format_plan warns of them in one line. A
    plan of a layout without them has none (fsdp_plan)."""
    log = []
    with xla_log.captured(log):
        os.write(2, (REMATERIALIZATION + "I1128 an unrelated line\n" + REMATERIALIZATION + UNNAMED).encode())
    assert capfd.readouterr().err.count("Involuntary full rematerialization") == 3
    operations = xla_log.rematerializations("".join(log))
    name = "while/body/eval_jaxpr/transpose(jvp(Llama))/while/body/eval_jaxpr/checkpoint/layers/sharding_constraint"
    assert operations == (name, name, "an unnamed parameter")
    assert fsdp_plan.rematerialized == () and "partitioner" not in format_plan(fsdp_plan)
    warning = format_plan(dataclasses.replace(fsdp_plan, rematerialized=operations)).splitlines()[-1]
    assert warning.startswith("WARNING: XLA's partitioner replicated 3 tensor(s) whole")
    assert "layers/sharding_constraint x2, an unnamed parameter." in warning
