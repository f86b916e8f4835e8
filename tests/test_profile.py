"""run.profile_steps and `llama-jax profile`: a tiny run traces two steps in jax's own layout (XProf reads it), the
command says where their time went; the classifier and the trace arithmetic on hand-written HLO and traces; bad
input is one line, exit 2, nothing written."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_environment, write_tiny_yaml
from test_readme import llama_jax_args, readme_commands

from llama_jax import cli
from llama_jax.perf import op_class, profile


def documented(command: str) -> list[str]:
    """The arguments of the one documented `llama-jax COMMAND ...` line that profiles."""
    lines = [line for line in readme_commands(f"llama-jax {command} ") if "profile" in line]
    assert len(lines) == 1, lines
    return llama_jax_args(lines[0])


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> Path:
    """The documented train command's overrides (steps 5 to 7 traced) on the tests' tiny model, 7 steps."""
    root = tmp_path_factory.mktemp("profiled")
    config = write_tiny_yaml(root)
    run_dir = root / "run"
    preset, *overrides = documented("train")[1:]
    assert preset == "tiny" and overrides == ["run.profile_steps=[5,7]"]
    subprocess.run(
        [sys.executable, "-m", "llama_jax", "train", str(config), *overrides, "train.steps=7", f"run.dir={run_dir}"],
        check=True,
        capture_output=True,
        env=subprocess_environment(),
        timeout=300,
    )
    return run_dir


def test_the_documented_profile_commands(profiled, capsys):
    args = documented("profile")
    assert args == ["profile", "runs/tiny"]
    assert cli.main([*args[:-1], str(profiled)]) == 0
    assert "3 step(s) 5-7" in capsys.readouterr().out


def test_a_run_writes_its_profile_where_xprof_reads_it(profiled):
    sessions = list((profiled / "profile" / "plugins" / "profile").iterdir())
    assert len(sessions) == 1
    assert [p.suffixes[-2:] for p in sessions[0].glob("*.xplane.pb")] == [[".xplane", ".pb"]]
    assert len(list(sessions[0].glob("*.trace.json.gz"))) == 1
    assert (profiled / "profile" / "step.hlo.txt").read_text().startswith("HloModule jit_train_step")


def test_profile_prints_where_the_steps_went(profiled, capsys):
    assert cli.main(["profile", str(profiled)]) == 0
    out = capsys.readouterr().out
    assert "3 step(s) 5-7" in out and "classified by the step HLO" in out
    matmul = next(line for line in out.splitlines() if line.strip().startswith("matmul fp32"))
    assert float(matmul.split()[2]) > 0  # ms per step
    assert "idle (host gaps)" in out and "not hidden behind compute" in out


def test_profile_json(profiled, capsys):
    assert cli.main(["profile", str(profiled), "--json", "--top", "10"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in found["steps"]] == [5, 6, 7] and found["step_ms"] > 0
    assert found["classes"]["matmul fp32"]["ms"] > 0 and found["module"] == "jit_train_step"
    assert len(found["top"]) == 10 and found["top"][0]["ms"] >= found["top"][-1]["ms"]
    assert not any("eval_jaxpr" in row["source"] for row in found["top"])  # jax's own scopes dropped
    assert any(row["source"].startswith(("layers/", "backward ")) for row in found["top"])  # where in the model


def test_a_run_dir_without_a_profile_is_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["profile", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no profile" in err and "run.profile_steps" in err
    assert list(tmp_path.iterdir()) == []
    assert cli.main(["profile", str(tmp_path), "--top", "0"]) == 2


@pytest.mark.parametrize("steps", ["[3,2]", "[0,2]", "[2,5]", "[2]", "[1,2,3]"])
def test_bad_profile_steps_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, steps):
    run_dir = tmp_path / "run"
    assert (
        cli.main(
            [
                "train",
                "tiny",
                "train.steps=4",
                "train.warmup_steps=0",
                f"run.profile_steps={steps}",
                f"run.dir={run_dir}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.profile_steps must be [FIRST, LAST]" in err
    assert not run_dir.exists()


# -- the classifier, on a module written by hand ------------------------------------------------------------------

HLO = """HloModule jit_step, is_scheduled=true

%fused_dot (p0: f8e4m3fn[4,8], p1: f8e4m3fn[8,4]) -> bf16[4,4] {
  %p0 = f8e4m3fn[4,8]{1,0} parameter(0)
  %p1 = f8e4m3fn[8,4]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_move (p0: f32[4,8]) -> f32[8,4] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %transpose.2 = f32[8,4]{0,1} transpose(%p0), dimensions={1,0}
  ROOT %copy.3 = f32[8,4]{1,0} copy(%transpose.2)
}

%fused_add (p0: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  ROOT %add.4 = f32[4,8]{1,0} add(%p0, %p0)
}

ENTRY %main (a: bf16[4,8], b: bf16[8,4], c: f32[4,8], d: f8e4m3fn[4,8], e: f8e4m3fn[8,4]) -> f32[4,8] {
  %a = bf16[4,8]{1,0} parameter(0)
  %b = bf16[8,4]{1,0} parameter(1)
  %c = f32[4,8]{1,0} parameter(2)
  %d = f8e4m3fn[4,8]{1,0} parameter(3)
  %e = f8e4m3fn[8,4]{1,0} parameter(4)
  %dot.5 = bf16[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, PROJECTION
  %dot.6 = bf16[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, SCORES
  %fp8_fusion = bf16[4,4]{1,0} fusion(%d, %e), kind=kCustom, calls=%fused_dot
  %gemm.7 = (f32[4,4]{1,0}, s8[64]{0}) custom-call(%c, %c), custom_call_target="__cublas$lt$matmul"
  %gemm.8 = (bf16[4,4]{1,0}, s8[64]{0}) custom-call(%d, %e), custom_call_target="__cublas$lt$matmul$f8"
  %fmha.9 = (bf16[4,4]{1,0}, u8[0]{0}) custom-call(%a, %b), custom_call_target="__cudnn$fmhaSoftmax"
  %all-reduce-start.10 = f32[4,8]{1,0} all-reduce-start(%c), replica_groups={{0,1}}, to_apply=%fused_add
  %all-reduce-done.11 = f32[4,8]{1,0} all-reduce-done(%all-reduce-start.10)
  %copy_fusion = f32[8,4]{1,0} fusion(%c), kind=kLoop, calls=%fused_move
  %transpose.12 = f32[8,4]{0,1} transpose(%c), dimensions={1,0}
  %add_fusion = f32[4,8]{1,0} fusion(%c), kind=kLoop, calls=%fused_add
  ROOT %sort.13 = f32[4,8]{1,0} sort(%add_fusion), dimensions={1}, to_apply=%fused_add
}
""".replace("PROJECTION", 'metadata={op_name="jit(step)/jvp(Llama)/layers/attn/q_proj/dot_general"}').replace(
    "SCORES", 'metadata={op_name="jit(step)/transpose(jvp(Llama))/layers/attn/vmap(BTNH,BSNH->BNTS)/dot_general"}'
)


def test_each_op_is_classified_by_what_the_hlo_says_it_is():
    classes, sources = op_class.op_classes(HLO)
    assert {
        name: classes[name]
        for name in (
            "dot.5",
            "dot.6",
            "fp8_fusion",
            "gemm.7",
            "gemm.8",
            "fmha.9",
            "all-reduce-start.10",
            "all-reduce-done.11",
            "copy_fusion",
            "transpose.12",
            "add_fusion",
            "sort.13",
        )
    } == {
        "dot.5": "matmul bf16",
        "dot.6": "attention",
        "fp8_fusion": "matmul fp8",
        "gemm.7": "matmul fp32",
        "gemm.8": "matmul fp8",
        "fmha.9": "attention",
        "all-reduce-start.10": "collective",
        "all-reduce-done.11": "collective",
        "copy_fusion": "copy/transpose",
        "transpose.12": "copy/transpose",
        "add_fusion": "fusion",
        "sort.13": "other",
    }
    assert sources["dot.5"] == "layers/attn/q_proj/dot_general"
    assert sources["dot.6"] == "backward layers/attn/vmap(BTNH,BSNH->BNTS)/dot_general"
    assert profile.module_name(HLO) == "jit_step"


def test_without_the_hlo_the_names_decide():
    assert [
        op_class.class_by_name(n)
        for n in ("dot.3", "cublas_gemm", "all-gather-start", "copy.2", "loop_fusion", "while.1")
    ] == ["matmul", "matmul", "collective", "copy/transpose", "fusion", "other"]


# -- the trace arithmetic, on a trace written by hand ------------------------------------------------------------


def _trace(run_dir: Path, events: list[dict]) -> None:
    session = run_dir / "profile" / "plugins" / "profile" / "2026_01_01_00_00_00"
    session.mkdir(parents=True)
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8"}},
        {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    with gzip.open(session / "host.trace.json.gz", "wt") as stream:
        json.dump({"displayTimeUnit": "ns", "traceEvents": meta + events}, stream)
    (run_dir / "profile" / "step.hlo.txt").write_text(HLO)


def _op(name: str, start: float, duration: float, run: str, tid: int = 7, pid: int = 1, kernel: str = "") -> dict:
    return {
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start,
        "dur": duration,
        "name": kernel or name,
        "args": {"hlo_op": name, "hlo_module": "jit_step(3)", "run_id": run},
    }


def test_times_per_step_idle_and_collectives_not_hidden(tmp_path):
    events = [
        {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 5, "name": "train", "args": {"step_num": "7"}},
        {"ph": "X", "pid": 2, "tid": 1, "ts": 1000, "dur": 5, "name": "train", "args": {"step_num": "8"}},
    ]
    for run, t0 in (("1", 0.0), ("2", 1000.0)):
        events += [
            _op("gemm.7", t0 + 10, 400, run, kernel="sm90_xmma_gemm"),  # 10-410
            _op("add_fusion", t0 + 500, 100, run),  # 500-600, after 90 us of idle
            _op("all-reduce-start.10", t0 + 300, 400, run, tid=8),  # 300-700: 100 us hidden by nothing
            _op("gemm.7", t0 + 10, 400, run, tid=9),  # the derived XLA Ops lane: not counted again
            _op("dot.5", t0, 10, run, pid=2),
        ]  # the host's launch: not the device's time
    _trace(tmp_path, events)
    found = profile.profile_run(tmp_path, top=2)
    assert found["module"] == "jit_step" and found["classified_by"] == "hlo"
    assert [s["step"] for s in found["steps"]] == [7, 8]
    assert found["step_ms"] == pytest.approx(0.69)  # 10 .. 700
    assert found["idle_ms"] == pytest.approx(0.0)  # the collective covers 410-500
    assert found["classes"]["matmul fp32"]["ms"] == pytest.approx(0.4)
    assert found["classes"]["collective"]["ms"] == pytest.approx(0.4)
    assert found["collective_exposed_ms"] == pytest.approx(0.19)  # 410-500 and 600-700
    assert [row["op"] for row in found["top"]] == ["gemm.7", "all-reduce-start.10"]
    assert found["top"][0]["kernel"] == "sm90_xmma_gemm" and found["top"][0]["count"] == 1


def test_an_enclosing_op_is_charged_only_its_own_time(tmp_path):
    events = [_op("while.1", 0, 100, "1"), _op("add_fusion", 10, 30, "1"), _op("copy_fusion", 50, 40, "1")]
    _trace(tmp_path, events)
    found = profile.profile_run(tmp_path)
    assert found["classes"]["fusion"]["ms"] == pytest.approx(0.03)
    assert found["classes"]["copy/transpose"]["ms"] == pytest.approx(0.04)
    assert found["classes"]["other"]["ms"] == pytest.approx(0.03)  # while.1: 100 - 30 - 40
    assert found["idle_ms"] == pytest.approx(0.0) and found["step_ms"] == pytest.approx(0.1)
