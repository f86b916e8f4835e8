"""`llama-jax tune` on 8 simulated CPU devices with a tiny model."""

import itertools
import json
import math
import re

import pytest
from conftest import write_tiny_yaml

from llama_jax import cli, config
from llama_jax.config.stages import resolve
from llama_jax.errors import ConfigError
from llama_jax.perf import costmodel
from llama_jax.perf.costmodel import INTER_HOST, INTRA_HOST, CostModel
from llama_jax.planning import plan, tune, tune_report
from llama_jax.training.program import TrainProgram

# The end-to-end search pins tensor and sequence to 1 to keep compilations few: 4 meshes.
PINNED = [
    "mesh.pipeline=1",
    "mesh.tensor=1",
    "mesh.sequence=1",
    "train.batch_size=16",
]  # 16: 2 micro-batches on 8 shards
SEARCH = ["--policies", "none,full", "--microbatches", "1,2", "--every-n-layers", "1", "--meshes", "1"]
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
OPTIONS = tune.Options(
    policies=("none", "full"),
    microbatches=(1, 2),
    every_n_layers=(1,),
    meshes=1,
    top_k=2,
    steps=2,
    measure=True,
    progress=False,
)


def test_candidate_space_is_complete_and_every_rejection_has_a_reason(tmp_path):
    source = str(write_tiny_yaml(tmp_path))
    space = tune.candidate_space(8, [], ("none", "full"), (1, 2), (1, 2))
    # An independent enumeration: every 5-tuple of sizes whose product is 8, pipeline repeats 1 and 2 and both
    # schedules with a pipeline, sequence parallelism both ways when tensor > 1, every micro-batch count (times the
    # stages), every policy, every-n only when recomputing.
    expected = {
        tune.Candidate(d, f, t, s, sp, p * mb, policy, every, p, r, schedule)
        for p, d, f, t, s in itertools.product(range(1, 9), repeat=5)
        if p * d * f * t * s == 8
        for r in ((1, 2) if p > 1 else (1,))
        for schedule in (("gpipe", "1f1b") if p > 1 else ("gpipe",))
        for sp in ((True, False) if t > 1 else (True,))
        for mb in (1, 2)
        for policy in ("none", "full")
        for every in ((1,) if policy == "none" else (1, 2))
    }
    assert len([c for c in space if c.pipeline == 1]) == 30 * 2 * 3  # the meshes without a pipeline
    assert len(space) == len(set(space)) == len(expected)
    assert set(space) == expected

    results = tune.validate_candidates(config.load_config(source), space)
    assert len(results) == len(space)
    valid = [r for r in results if r.config is not None]
    rejected = [r for r in results if r.config is None]
    assert valid and rejected
    assert all(r.rejected and r.config is None for r in rejected)  # a reason for each one
    for r in valid:  # each valid candidate's config is the candidate
        c, cfg = r.candidate, r.config
        assert (
            cfg.mesh.pipeline,
            cfg.mesh.pipeline_repeats,
            cfg.mesh.data,
            cfg.mesh.fsdp,
            cfg.mesh.tensor,
            cfg.mesh.sequence,
        ) == (c.pipeline, c.repeats, c.data, c.fsdp, c.tensor, c.sequence)
        assert (cfg.train.microbatches, cfg.remat.policy, cfg.remat.every_n_layers) == (
            c.microbatches,
            c.policy,
            c.every_n_layers,
        )
        assert (cfg.mesh.pipeline_schedule, cfg.mesh.pipeline_microbatches) == (c.schedule, c.per_pass)
    # The tiny model has 2 layers, 4 query / 2 kv heads and a batch of 8: tensor=8, data x fsdp x micro-batches
    # above 8 and more pipeline stages x repeats than layers are refused with the mesh checks' own words.
    reasons = {r.candidate: r.rejected for r in rejected}
    assert all("mesh.tensor (8)" in reasons[c] for c in space if c.tensor == 8)
    assert all(
        "data×fsdp×microbatches" in reasons[c] or "not divisible by train.microbatches" in reasons[c]
        for c in space
        if c.tensor != 8 and c.data * c.fsdp * c.microbatches > 8
    )
    assert all(
        "mesh.pipeline × mesh.pipeline_repeats" in reasons[c]
        for c in space
        if c.tensor != 8 and c.data * c.fsdp * c.microbatches <= 8 and c.pipeline * c.repeats > 2
    )
    assert {
        c
        for c in space
        if c.tensor != 8
        and c.data * c.fsdp * c.microbatches <= 8
        and c.pipeline * c.repeats <= 2
        and (c.pipeline == 1 or 2 // (c.pipeline * c.repeats) % c.every_n_layers == 0)  # every-n within a stage
        and 32 % (c.sequence * (c.tensor if c.sequence_parallel else 1) * (2 if c.sequence > 1 else 1)) == 0
    } == {r.candidate for r in valid}


def test_searched_keys_given_on_the_command_line_are_pinned():
    space = tune.candidate_space(
        8, ["mesh.tensor=2", "remat.policy=full", "train.microbatches=2"], ("none", "full"), (1, 2, 4), (1, 2)
    )
    assert space and all(c.tensor == 2 and c.policy == "full" and c.microbatches == 2 for c in space)
    assert {c.every_n_layers for c in space} == {1, 2}
    # With a pipeline: the schedules, and passes of P micro-batches where fewer than all (here: 2 stages, 4).
    space = tune.candidate_space(
        8,
        ["mesh.pipeline=2", "mesh.pipeline_schedule=1f1b", "train.microbatches=4"],
        ("full",),
        (1,),
        (1,),
        (1,),
        passes=(0, 1, 2),
    )
    assert {(c.schedule, c.per_pass) for c in space} == {("1f1b", 0), ("1f1b", 2)}
    assert "p2-1f1b" in space[0].label and any("mb4/2 " in c.label for c in space)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One measured search (module-wide; later searches of these tests hit its cache)."""
    root = tmp_path_factory.mktemp("tune")
    source = str(write_tiny_yaml(root))
    report = tune.tune(source, PINNED, OPTIONS)
    out = root / "winner.yaml"
    tune_report.write_winner(report, out)
    return root, source, report, out


def test_the_winner_is_the_fastest_measured_candidate(searched):
    _, _, report, _ = searched
    measured = [r for r in report.results if r.measured_s is not None]
    assert len(measured) >= 2  # the top 2 by prediction, plus the default when it ranks lower
    assert report.winner.measured_s == min(r.measured_s for r in measured)
    assert report.default in measured
    table = tune_report.format_report(report)
    assert "<- default" in table and report.winner.candidate.label in table


def test_search_scores_every_mesh_then_the_best_with_every_setting(searched):
    _, _, report, _ = searched
    scored = [r for r in report.results if r.predicted_s is not None]
    assert {r.candidate.mesh_key for r in scored} == {(1, 1, d, 8 // d, 1, 1, True) for d in (1, 2, 4, 8)}
    best = min(
        (r for r in scored if r.candidate.microbatches == 1 and r.candidate.policy == "none"),
        key=lambda r: r.predicted_s,
    ).candidate.mesh_key
    for mesh in {best, report.default.candidate.mesh_key}:
        assert {(r.candidate.microbatches, r.candidate.policy) for r in scored if r.candidate.mesh_key == mesh} == {
            (1, "none"),
            (1, "full"),
            (2, "none"),
            (2, "full"),
        }
    assert all(r.memory_bytes > 0 and r.hlo_flops > 0 and r.predicted_s > 0 for r in scored)


def test_the_winner_yaml_loads_and_trains(searched, tmp_path):
    _, _, report, out = searched
    assert out.read_text().startswith("# Written by llama-jax tune")
    loaded = config.load_config(str(out))
    assert config.to_dict(loaded) == config.to_dict(report.winner.config)
    run_dir = tmp_path / "run"
    assert cli.main(["train", str(out), "train.steps=2", f"run.dir={run_dir}", "checkpoint.every_steps=0"]) == 0
    assert (run_dir / "metrics.jsonl").exists()


def test_a_rerun_is_answered_from_the_cache(searched, monkeypatch):
    _, source, report, _ = searched

    def compiled_again(*args, **kwargs):
        raise AssertionError("a cached candidate was compiled or built again")

    monkeypatch.setattr(plan, "make_plan", compiled_again)
    monkeypatch.setattr(TrainProgram, "build", compiled_again)
    again = tune.tune(source, PINNED, OPTIONS)
    assert again.winner.candidate == report.winner.candidate
    assert [r.predicted_s for r in again.results] == [r.predicted_s for r in report.results]


def test_a_memory_budget_below_the_smallest_candidate_exits_2_saying_by_how_much(searched, capsys):
    root, source, report, _ = searched
    out = root / "too_small.yaml"
    budget = 100 * 2**10  # 100 KiB, below the tiny model's ~1 MiB
    code = cli.main(
        ["tune", source, *PINNED, *SEARCH, "--memory-gb", str(budget / 2**30), "--no-measure", "--out", str(out)]
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "memory budget of 100.00 KiB" in err
    needs, more = (float(n) * UNITS[u] for n, u in re.findall(r"([\d.]+) ([KMG]iB)", err.split("needs ")[1])[:2])
    assert more == pytest.approx(needs - budget, abs=0.01 * UNITS["MiB"])  # both printed with 2 decimals
    # The leanest it compiled: at most the leanest of the first search (which saw other meshes' settings).
    leanest = min(r.memory_bytes for r in report.results if r.memory_bytes)
    assert 0 < needs <= leanest * 1.01
    assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policies", "none,fastest"], "unknown remat policy 'fastest'"),
        (["modle.n_layers=2"], "model.n_layers"),
        (["--top-k", "0"], "--top-k"),
        (
            ["--devices-per-host", "3"],
            "--devices-per-host 3 does not divide the 8 devices into hosts; use one of 1, 2, 4, 8",
        ),
        (["--nic-gbs", "-1"], "--nic-gbs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    out = tmp_path / "tune.yaml"
    assert cli.main(["tune", str(write_tiny_yaml(tmp_path)), *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not out.exists()


def test_cost_model_is_a_roofline_plus_exposed_communication_on_each_tier():
    model = CostModel(
        peak_flops=100.0, memory_bandwidth=10.0, link_bandwidth=5.0, nic_bandwidth=2.0, efficiency=0.5, overlap=0.4
    )
    operations = [(100.0, 10.0), (0.0, 30.0)]  # compute-bound: 2 s; memory-bound: 3 s
    assert model.predict(operations, {INTRA_HOST: 50.0, INTER_HOST: 8.0}) == pytest.approx(2 + 3 + 0.6 * (10 + 4))
    # Between hosts the bytes also cross the device's own link: a NIC faster than the link does not help.
    fast_nic = CostModel(peak_flops=100.0, memory_bandwidth=10.0, link_bandwidth=5.0, nic_bandwidth=50.0)
    assert fast_nic.bandwidth(INTER_HOST) == 5.0
    # fp8 matmuls' FLOPs (an operation's third figure) at the fp8 peak, the others at the compute dtype's.
    fp8 = CostModel(
        peak_flops=100.0,
        memory_bandwidth=10.0,
        link_bandwidth=5.0,
        nic_bandwidth=2.0,
        efficiency=0.5,
        fp8_peak_flops=200.0,
    )
    assert fp8.compute_seconds([(100.0, 10.0, 60.0), (0.0, 30.0, 0.0)]) == pytest.approx(40 / 50 + 60 / 100 + 3)
    assert model.compute_seconds([(100.0, 10.0, 60.0)]) == pytest.approx(2)  # no fp8 peak: all at the same rate


def test_spearman():
    assert tune.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert tune.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert tune.spearman([1, 2], [1, 2]) is None
    assert math.isclose(tune.spearman([1, 2, 3], [1, 3, 2]), 0.5)


class FakeGpu:
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def memory_stats(self):
        return {"bytes_limit": 72 * 2**30}  # the allocator's share of an 80 GB H100 under launch/gpu_env.sh


def test_gpus_get_data_sheet_figures_and_their_memory(monkeypatch, tmp_path):
    import jax

    from llama_jax.perf import costmodel, hardware

    monkeypatch.setattr(jax, "devices", lambda *args: [FakeGpu()] * 8)
    monkeypatch.setattr(jax, "local_devices", lambda *args: [FakeGpu()] * 8)
    model = costmodel.default_cost_model("bfloat16", tmp_path)
    assert (model.peak_flops, model.memory_bandwidth, model.link_bandwidth) == (989e12, 3350e9, 450e9)
    assert model.nic_bandwidth == 50e9  # one 400 Gb/s NIC per GPU
    assert (model.efficiency, model.overlap, model.fp8_peak_flops) == (0.7, 0.5, 1979e12)
    assert costmodel.data_sheet_cost_model("bfloat16", FakeGpu.device_kind) == model
    assert costmodel.data_sheet_cost_model("float32", "cpu") is None  # a CPU's figures are measured
    assert hardware.default_memory_budget() == hardware.memory_budget(0) == 72 * 2**30
    assert hardware.memory_budget(60) == 60 * 2**30
    assert not hardware.simulated_devices()


def test_the_cli_states_the_defaults_tune_uses():
    """`llama-jax tune --help` must not drift from the code: the policies searched and the cost model's defaults."""
    from llama_jax.perf import hardware

    (parser,) = [action.choices["tune"] for action in cli.build_parser()._actions if action.choices]
    options = {action.dest: action for action in parser._actions}
    assert tuple(options["policies"].default.split(",")) == tune.DEFAULT_POLICIES == tune.Options().policies
    assert f"{costmodel.GPU_EFFICIENCY:g} on GPUs, {costmodel.CPU_EFFICIENCY:g} on CPUs" in options["efficiency"].help
    assert f"{costmodel.GPU_OVERLAP:g} GPU, 0 CPU" in options["overlap"].help
    assert f"default {hardware.NIC_GBS:g}: one 400 Gb/s NIC per GPU" in options["nic_gbs"].help
    assert hardware.NIC_GBS * 8 == 400  # GB/s x 8 bits = Gb/s


# --------------------------------------------------------------------------------------------
# Link tiers: which collectives cross hosts

MESH_AXES = ("data", "fsdp", "sequence", "tensor")
# 8 devices as fsdp=4 x tensor=2 (position = 2 x fsdp + tensor) on 2 hosts of 4.
TWO_HOSTS = costmodel.cluster_topology(MESH_AXES, (1, 4, 1, 2), devices_per_host=4)
HLO = """HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  %tensor = f32[1024]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %fsdp = f32[1024]{0} all-gather(%p), channel_id=2, replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}
  %fsdp_in_host = f32[1024]{0} all-gather(%p), channel_id=3, replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}
  %all = f32[256]{0} all-reduce(%p), channel_id=4, replica_groups={}, to_apply=%add
  ROOT %r = f32[1024]{0} copy(%p)
}
"""


def test_hosts_split_the_outermost_axes_first():
    assert TWO_HOSTS.hosts == (0, 0, 0, 0, 1, 1, 1, 1)
    assert [TWO_HOSTS.axis_tier(a) for a in MESH_AXES] == [INTRA_HOST, INTER_HOST, INTRA_HOST, INTRA_HOST]
    hosts_of_two = costmodel.cluster_topology(MESH_AXES, (2, 1, 1, 4), devices_per_host=2)
    assert [hosts_of_two.axis_tier(a) for a in MESH_AXES] == [INTER_HOST, INTRA_HOST, INTRA_HOST, INTER_HOST]


@pytest.mark.parametrize("shape, hosts", [((1, 4, 1, 2), 2), ((2, 2, 1, 2), 4), ((1, 2, 2, 4), 4), ((2, 8, 1, 4), 8)])
def test_planned_hosts_are_where_make_mesh_puts_a_multi_host_run(shape, hosts):
    """--devices-per-host must plan the layout sharding.make_mesh builds from the processes' devices."""
    from dataclasses import dataclass

    from jax.experimental import mesh_utils

    from llama_jax.distributed import sharding

    @dataclass(frozen=True)
    class Device:
        id: int
        process_index: int
        platform: str = "cpu"
        device_kind: str = "cpu"

    devices = [Device(i, i * hosts // math.prod(shape)) for i in range(math.prod(shape))]
    grid = mesh_utils.create_hybrid_device_mesh(
        *sharding.split_over_hosts(shape, hosts), devices, process_is_granule=True
    )
    planned = costmodel.cluster_topology(MESH_AXES, shape, math.prod(shape) // hosts)
    assert planned.hosts == tuple(d.process_index for d in grid.flat)


def test_collectives_are_priced_at_the_tier_their_groups_cross():
    from llama_jax.perf.costmodel import AxisTraffic
    from llama_jax.perf.hlo import analyze

    traffic = costmodel.traffic_by_axis(analyze(HLO, num_devices=8).collective_groups, TWO_HOSTS)
    # Ring bytes per device of a 4 KiB result: all-reduce 2(n-1)/n, all-gather (n-1)/n.
    assert set(traffic) == {
        AxisTraffic(("tensor",), "all-reduce", INTRA_HOST, 4096.0),  # pairs within a host
        AxisTraffic(("fsdp",), "all-gather", INTER_HOST, 3072.0),  # the whole fsdp axis spans both hosts
        AxisTraffic(("fsdp",), "all-gather", INTRA_HOST, 2048.0),  # fsdp pairs {0,2}, {1,3}, ... stay inside
        AxisTraffic(("fsdp", "tensor"), "all-reduce", INTER_HOST, 2 * 7 / 8 * 1024),  # every device
    }
    tiers = costmodel.tier_totals(traffic)
    assert tiers == {INTRA_HOST: 4096 + 2048, INTER_HOST: 3072 + 1792}
    h100 = CostModel(peak_flops=989e12, memory_bandwidth=3350e9, link_bandwidth=450e9, nic_bandwidth=50e9)
    assert h100.communication_seconds(tiers) == pytest.approx((4096 + 2048) / 450e9 + (3072 + 1792) / 50e9)
    one_host = costmodel.cluster_topology(MESH_AXES, (1, 4, 1, 2), devices_per_host=8)
    assert costmodel.tier_totals(costmodel.traffic_by_axis(analyze(HLO, 8).collective_groups, one_host)) == {
        INTRA_HOST: 4096 + 3072 + 2048 + 1792,
        INTER_HOST: 0,
    }


def test_one_process_is_one_host():
    import jax

    mesh = jax.make_mesh((1, 4, 1, 2), MESH_AXES)
    topology = costmodel.mesh_topology(mesh)
    assert topology.hosts == (0,) * 8 and topology.shape == (1, 4, 1, 2) and topology.axis_names == MESH_AXES
    assert costmodel.mesh_topology(mesh, devices_per_host=4).hosts == TWO_HOSTS.hosts
    with pytest.raises(ConfigError, match="--devices-per-host 16 does not divide the 8 devices"):
        costmodel.mesh_topology(mesh, devices_per_host=16)


def test_auto_micro_batches_are_searched_as_train_resolves_them(tmp_path):
    """A config with train.microbatches=auto (the Llama 3 presets'): the default candidate, the baseline of every
    speed-up, is what `llama-jax train` would run -- auto, resolved against the same budget when it compiles -- and
    train.microbatches=auto pinned on the command line keeps every candidate on auto (it was int('auto'))."""
    source = str(write_tiny_yaml(tmp_path, train={"microbatches": "auto"}))
    overrides = PINNED + ["mesh.data=1", "mesh.fsdp=8"]
    _, default, results = tune.enumerate_candidates(config.load_config(source, overrides), overrides, OPTIONS)
    assert default.microbatches == "auto" and " mbauto " in f" {default.label} "
    baseline = next(r for r in results if r.candidate == default)
    assert baseline.config is not None and baseline.config.train.microbatches == "auto"
    pins = PINNED + ["train.microbatches=auto"]
    _, _, pinned = tune.enumerate_candidates(config.load_config(source, pins), pins, OPTIONS)
    assert {r.candidate.microbatches for r in pinned} == {"auto"} and any(r.config is not None for r in pinned)
    options = tune.Options(
        policies=("none",), microbatches=(1, 2), every_n_layers=(1,), meshes=1, measure=False, progress=False
    )
    report = tune.tune(source, overrides, options)
    resolved = TrainProgram.for_config(baseline.config)  # what train runs: the fewest micro-batches that fit
    assert report.default.candidate.microbatches == "auto"
    assert report.default.memory_bytes == plan.make_plan(resolved.config, resolved.mesh).total_bytes


def test_the_cache_is_keyed_by_the_whole_package_not_only_training():
    names = {path.relative_to(tune.PACKAGE).as_posix() for path in tune.source_files()}
    assert {"model/llama.py", "model/attention.py", "training/step.py", "distributed/sharding.py"} <= names


def test_a_staged_run_is_tuned_stage_by_stage_and_the_file_keeps_its_stages(tmp_path, capsys):
    """train.stages: each stage's micro-batches and remat policy are searched on the mesh it runs (the second
    stage's: sequences split over 2 devices, so fsdp 4), the first stage's pinned by the command line's
    train.microbatches (1, where --microbatches says 2); each stage's winner is its fastest predicted candidate.
    The file written keeps the mesh as the config has it (fsdp -1, so the second stage still gives way to
    mesh.sequence=2) and puts each winner where the stage takes it: train.* and remat.*, or its train.stages
    entry."""
    stages = [{"start_step": 6, "seq_len": 64, "batch_size": 8, "sequence": 2, "microbatches": 2, "remat": "full"}]
    source = str(write_tiny_yaml(tmp_path, train={"stages": stages}))
    out = tmp_path / "tuned.yaml"
    pins = ["mesh.pipeline=1", "mesh.tensor=1", "mesh.data=1", "train.microbatches=1"]
    search = ["--policies", "none", "--microbatches", "2", "--every-n-layers", "1", "--no-measure", "--json"]
    assert cli.main(["tune", source, *pins, *search, "--out", str(out)]) == 0
    first, second = json.loads(capsys.readouterr().out)
    assert (first["stage"], first["last_step"], second["first_step"], second["last_step"]) == (1, 6, 6, 12)
    candidates = {
        s["stage"]: [c["candidate"] for c in s["candidates"] if c["predicted_s"] is not None] for s in (first, second)
    }
    assert {c["microbatches"] for c in candidates[1]} == {1} and {c["microbatches"] for c in candidates[2]} == {2}
    assert {c["policy"] for c in candidates[2]} == {"none", "full"}  # --policies, and the stage's own
    assert {(c["fsdp"], c["sequence"]) for c in candidates[1]} == {(8, 1)}
    assert {(c["fsdp"], c["sequence"]) for c in candidates[2]} == {(4, 2)}
    for s in (first, second):
        ranked = [c for c in s["candidates"] if c["predicted_s"] is not None and c["rejected"] is None]
        assert s["winner"] == min(ranked, key=lambda c: c["predicted_s"])["label"]
    winners = {
        s["stage"]: next(c["candidate"] for c in s["candidates"] if c["label"] == s["winner"]) for s in (first, second)
    }
    written = config.load_config(str(out))
    entry = written.train.stages[0]
    assert (written.train.microbatches, written.remat.policy) == (winners[1]["microbatches"], winners[1]["policy"])
    assert (entry.microbatches, entry.remat, entry.sequence) == (winners[2]["microbatches"], winners[2]["policy"], 2)
    assert written.mesh.fsdp == -1 and out.read_text().startswith("# Written by llama-jax tune, stage by stage")
    assert [s.config.mesh.sequence for s in resolve(written)] == [1, 2]
