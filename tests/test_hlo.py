"""Tests for llama_jax.perf.hlo: hand-written HLO snippets plus a few real compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from llama_jax.perf.hlo import KINDS, analyze, permute_loop_trips, roofline_seconds, shape_bytes

ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def module(*computations: str) -> str:
    return "HloModule m, is_scheduled=true, num_partitions=8\n\n" + "\n".join(computations)


def entry(*lines: str) -> str:
    body = "\n".join("  " + line for line in lines)
    return (
        f"ENTRY %main (p: f32[128], s: f32[]) -> f32[] {{\n  %p = f32[128]{{0}} parameter(0)\n"
        f"  %s = f32[] parameter(1)\n{body}\n  ROOT %r = f32[] copy(%s)\n}}\n"
    )


@pytest.mark.parametrize(
    "shape, expected",
    [
        ("f32[]", 4),
        ("s32[]", 4),
        ("pred[3]", 3),
        ("f32[32,128]{1,0}", 32 * 128 * 4),
        ("bf16[2,3]{1,0}", 12),
        ("f8e4m3fn[10]", 10),
        ("c64[2]", 16),
        ("token[]", 0),
        ("u64[2]", 16),
        ("(f32[], bf16[2,3])", 16),
        ("(f32[], f32[320,64]{1,0}, s8[1], u8[1], /*index=4*/f16[2]{0})", 4 + 81920 + 2 + 4),
        ("((f32[2]{0}, s32[]), /*index=1*/f64[1])", 8 + 4 + 8),
        ("f32[<=10]{0}", 40),
    ],
)
def test_shape_bytes(shape, expected):
    assert shape_bytes(shape) == expected


def test_shape_bytes_rejects_unknown_dtype():
    with pytest.raises(ValueError):
        shape_bytes("q7[3]")


@pytest.mark.parametrize(
    "line, kind, buffer, moved",
    [
        # mesh form: the group is the product of the listed axes
        (
            "%c = f32[1024]{0} all-gather(%p), channel_id=1, replica_groups=mesh['x'=4,'y'=2] {'x','y'}, "
            "dimensions={0}, use_global_device_ids=true",
            "all-gather",
            4096,
            4096 * 7 / 8,
        ),
        (
            "%c = f32[256]{0} all-gather(%p), replica_groups=mesh['x'=4,'y'=2] {'y'}, dimensions={0}",
            "all-gather",
            1024,
            1024 / 2,
        ),
        # a sub-axis (jax >= 0.11, Shardy): 'tensor':(1)2 is a part of size 2 of the axis of 8
        (
            "%c = f32[8,32,2,8]{3,1,0,2} all-gather(%p), channel_id=12, replica_groups=mesh['data'=1,'fsdp'=1,"
            "'sequence'=1,'tensor'=8] {'tensor':(1)2}, dimensions={2}, use_global_device_ids=true",
            "all-gather",
            16384,
            16384 / 2,
        ),
        (
            "%c = f32[64]{0} all-reduce(%p), replica_groups=mesh['x'=2,'y'=8] {'x','y':(2)4}, to_apply=%add",
            "all-reduce",
            256,
            2 * 7 / 8 * 256,
        ),
        # explicit groups: size of the first group
        (
            "%c = f32[128]{0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add",
            "all-reduce",
            512,
            2 * 3 / 4 * 512,
        ),
        # iota forms: the last dim of the first bracket
        (
            "%c = f32[16]{0} reduce-scatter(%p), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add",
            "reduce-scatter",
            64,
            3 * 64,
        ),
        (
            "%c = f32[128]{0} all-to-all(%p), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}",
            "all-to-all",
            512,
            512 / 2,
        ),
        # empty groups: all num_devices (8) devices
        (
            "%c = f32[128]{0} all-reduce(%p), channel_id=3, replica_groups={}, to_apply=%add",
            "all-reduce",
            512,
            2 * 7 / 8 * 512,
        ),
        # groups of one move nothing
        (
            "%c = f32[128]{0} all-reduce(%p), replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add",
            "all-reduce",
            512,
            0.0,
        ),
        (
            "%c = f32[128]{0} collective-permute(%p), channel_id=4, source_target_pairs={{0,1},{1,0}}",
            "collective-permute",
            512,
            512.0,
        ),
        # tuple results (a combined all-reduce) sum all their elements
        (
            "%c = (f32[], /*index=1*/f32[128]{0}) all-reduce(%s, %p), replica_groups={}, to_apply=%add",
            "all-reduce",
            516,
            2 * 7 / 8 * 516,
        ),
    ],
)
def test_collective_forms(line, kind, buffer, moved):
    stats = analyze(module(ADD, entry(line)), num_devices=8)
    assert set(stats.collectives) == set(KINDS)
    assert stats.collectives[kind].count == 1
    assert stats.collectives[kind].buffer_bytes == buffer
    assert stats.collectives[kind].moved_bytes == pytest.approx(moved)
    assert all(c.count == 0 for k, c in stats.collectives.items() if k != kind)
    assert stats.dot_flops == 0 and stats.unknown_trip_counts == 0


def test_async_pairs_count_the_start_and_its_output():
    text = module(
        ADD,
        entry(
            "%ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(%p), channel_id=1, replica_groups={}, dimensions={0}",
            "%agd = f32[1024]{0} all-gather-done(%ags)",
            "%ars = f32[128]{0} all-reduce-start(%p), channel_id=2, replica_groups={}, to_apply=%add",
            "%ard = f32[128]{0} all-reduce-done(%ars)",
            "%cps = (f32[128]{0}, f32[128]{0}, u32[], u32[]) collective-permute-start(%p), source_target_pairs={{0,1}}",
            "%cpd = f32[128]{0} collective-permute-done(%cps)",
        ),
    )
    c = analyze(text, num_devices=8).collectives
    assert (c["all-gather"].count, c["all-gather"].buffer_bytes) == (1, 4096)
    assert c["all-gather"].moved_bytes == pytest.approx(4096 * 7 / 8)
    assert (c["all-reduce"].count, c["all-reduce"].buffer_bytes) == (1, 512)
    assert (c["collective-permute"].count, c["collective-permute"].buffer_bytes) == (1, 512)


FUSED_DOT = """%fused_dot (param_0: f32[16,32], param_1: f32[32,8]) -> f32[16,8] {
  %param_0 = f32[16,32]{1,0} parameter(0)
  %param_1 = f32[32,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, \
metadata={op_name="jit(f)/dot_general"}
}
"""
DOT_FLOPS = 2 * 16 * 8 * 32
LOOP = "(s32[], f32[16,32]{1,0}, f32[32,8]{1,0})"


def loop_computations(name: str, inner: str = "", trip_config: str = "") -> str:
    """A while body `name` doing one fused dot and one all-gather (plus `inner` lines), and its condition."""
    return f"""%{name} (loop.{name}: {LOOP}) -> {LOOP} {{
  %loop.{name} = {LOOP} parameter(0)
  %i.{name} = s32[] get-tuple-element(%loop.{name}), index=0
  %x.{name} = f32[16,32]{{1,0}} get-tuple-element(%loop.{name}), index=1
  %w.{name} = f32[32,8]{{1,0}} get-tuple-element(%loop.{name}), index=2
  %f.{name} = f32[16,8]{{1,0}} fusion(%x.{name}, %w.{name}), kind=kOutput, calls=%fused_dot
  %ag.{name} = f32[256]{{0}} all-gather(%w.{name}), replica_groups={{}}, dimensions={{0}}
  {inner}
  ROOT %t.{name} = {LOOP} tuple(%i.{name}, %x.{name}, %w.{name})
}}

%cond.{name} (c.{name}: {LOOP}) -> pred[] {{
  %c.{name} = {LOOP} parameter(0)
  ROOT %k.{name} = pred[] constant(true)
}}
"""


def while_line(name: str, body: str, trips: str) -> str:
    config = f', backend_config={{"known_trip_count":{{"n":"{trips}"}}}}' if trips else ""
    return f"%{name} = {LOOP} while(%init), condition=%cond.{body}, body=%{body}{config}"


def loop_entry(*lines: str) -> str:
    return (
        f"""ENTRY %main (x: f32[16,32], w: f32[32,8]) -> f32[16,32] {{
  %x = f32[16,32]{{1,0}} parameter(0)
  %w = f32[32,8]{{1,0}} parameter(1)
  %zero = s32[] constant(0)
  %init = {LOOP} tuple(%zero, %x, %w)
"""
        + "\n".join("  " + line for line in lines)
        + "\n  ROOT %out = f32[16,32]{1,0} copy(%x)\n}\n"
    )


def test_while_with_known_trip_count_multiplies_fused_dot_and_collectives():
    text = module(FUSED_DOT, loop_computations("body"), loop_entry(while_line("loop", "body", "3")))
    stats = analyze(text, num_devices=8)
    assert stats.dot_flops == 3 * DOT_FLOPS
    assert stats.collectives["all-gather"].count == 3
    assert stats.collectives["all-gather"].buffer_bytes == 3 * 1024
    assert stats.unknown_trip_counts == 0


def test_nested_whiles_multiply():
    inner_while = while_line("inner", "inner_body", "5").replace("%init", "%loop.outer_body")
    text = module(
        FUSED_DOT,
        loop_computations("inner_body"),
        loop_computations("outer_body", inner_while),
        loop_entry(while_line("outer", "outer_body", "2")),
    )
    stats = analyze(text, num_devices=8)
    assert stats.dot_flops == (2 + 2 * 5) * DOT_FLOPS
    assert stats.collectives["all-gather"].count == 2 + 2 * 5


def test_missing_trip_count_counts_once():
    text = module(FUSED_DOT, loop_computations("body"), loop_entry(while_line("loop", "body", "")))
    stats = analyze(text, num_devices=8)
    assert stats.unknown_trip_counts == 1
    assert stats.dot_flops == DOT_FLOPS


def test_a_loop_whose_trip_count_xla_dropped_counts_to_its_conditions_bound():
    """XLA:GPU's collective pipeliner peels an iteration and leaves a loop without known_trip_count: its count is
    read from the condition (a fused `i < 7`) and the induction variable's start (a copy of constant 1)."""
    condition = f"""%fused_compare (param_0: s32[]) -> pred[] {{
  %param_0 = s32[] parameter(0)
  %bound = s32[] constant(7)
  ROOT %lt = pred[] compare(%param_0, %bound), direction=LT
}}

%cond.body (c.body: {LOOP}) -> pred[] {{
  %c.body = {LOOP} parameter(0)
  %i = s32[] get-tuple-element(%c.body), index=0
  ROOT %fused = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}}
"""
    body = loop_computations("body").split("%cond.body")[0]
    line = (
        f"%loop = {LOOP} while(%start_tuple), condition=%cond.body, body=%body, "
        'backend_config={"known_induction_variable":{"tuple_index":"0"},"dynamic_variables":[]}'
    )
    text = module(
        FUSED_DOT,
        body,
        condition,
        loop_entry(
            "%one = s32[] constant(1)", "%from = s32[] copy(%one)", f"%start_tuple = {LOOP} tuple(%from, %x, %w)", line
        ),
    )
    stats = analyze(text, num_devices=8)
    assert stats.unknown_trip_counts == 0 and stats.dot_flops == 6 * DOT_FLOPS


def test_a_double_buffered_pipeline_loop_counts_the_iterations_it_stands_for():
    """XLA:GPU's double buffering runs two iterations per trip (the induction variable steps by 2) and peels an
    odd count's last one into the caller: 5 trips of a 2-permute body plus one peeled permute are 11 iterations."""
    pairs = "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}"
    permutes = "\n  ".join(f"%cp{i}.body = f32[16,32]{{1,0}} collective-permute(%x.body), {pairs}" for i in (1, 2))
    config = '{"known_trip_count":{"n":"5"},"known_init_step":{"init":"0","step":"2"}}'
    text = module(
        FUSED_DOT,
        loop_computations("body", permutes),
        loop_entry(
            f"%loop = {LOOP} while(%init), condition=%cond.body, body=%body, backend_config={config}",
            f"%peeled = f32[16,32]{{1,0}} collective-permute(%x), {pairs}",
        ),
    )
    assert permute_loop_trips(text, 4, lambda groups: True) == [11]
    assert analyze(text, num_devices=4).dot_flops == 5 * DOT_FLOPS  # each trip's body holds what it runs


def test_quoted_backend_config_and_shared_callees_sum():
    line = while_line("loop", "body", "").replace(
        "body=%body", 'body=%body, backend_config="{\\"known_trip_count\\":{\\"n\\":\\"4\\"}}"'
    )
    text = module(
        FUSED_DOT,
        loop_computations("body"),
        loop_entry(line, "%f1 = f32[16,8]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot"),
    )
    assert analyze(text, num_devices=8).dot_flops == (4 + 1) * DOT_FLOPS


def test_dot_operand_shapes_from_header_and_conditional_branches():
    # The branch has no parameter instructions, so the lhs shape must come from its header.
    branch = """%branch (a: f32[4,6,10], b: f32[4,10,3]) -> f32[4,6,3] {
  ROOT %d = f32[4,6,3]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, \
rhs_contracting_dims={1}
}
"""
    text = module(
        branch,
        entry(
            "%pr = pred[] constant(true)",
            "%cd = f32[4,6,3]{2,1,0} conditional(%pr, %s, %s), true_computation=%branch, false_computation=%branch",
        ),
    )
    assert analyze(text, num_devices=1).dot_flops == 2 * (2 * 4 * 6 * 3 * 10)  # both branches: upper bound


def test_convolution_flops():
    text = module(
        entry(
            "%img = f32[1,8,8,4]{3,2,1,0} parameter(2)",
            "%k = f32[3,3,4,16]{3,2,1,0} parameter(3)",
            "%conv = f32[1,8,8,16]{3,2,1,0} convolution(%img, %k), window={size=3x3 pad=1_1x1_1}, "
            "dim_labels=b01f_01io->b01f",
        )
    )
    assert analyze(text, num_devices=1).dot_flops == 2 * (8 * 8 * 16) * (3 * 3 * 4)


def _xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_scan_counts_every_iteration_unlike_xla_cost_analysis():
    m, k, steps = 16, 32, 5

    def f(x, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    compiled = jax.jit(f).lower(jnp.ones((m, k)), jnp.ones((steps, k, k))).compile()
    stats = analyze(compiled.as_text(), num_devices=1)
    assert stats.dot_flops == steps * 2 * m * k * k
    assert stats.unknown_trip_counts == 0
    assert stats.dot_flops > _xla_flops(compiled)  # XLA counts the while body once


def test_a_named_conditional_counts_its_branches_as_often_as_they_run():
    """1F1B (one_f_one_b.py): a stage's pass runs in some iterations only; its conditional says how often."""
    m, k, steps = 16, 32, 8

    def f(x, ws):
        def step(c, w_and_i):
            w, i = w_and_i
            with jax.named_scope("sometimes"):
                return jax.lax.cond(i % 4 == 0, lambda c: jnp.tanh(c @ w), lambda c: c, c), None

        return jax.lax.scan(step, x, (ws, jnp.arange(steps)))[0]

    text = jax.jit(f).lower(jnp.ones((m, k)), jnp.ones((steps, k, k))).compile().as_text()
    assert analyze(text, num_devices=1).dot_flops == steps * 2 * m * k * k  # every branch, every time
    assert analyze(text, num_devices=1, branch_runs={"sometimes": 0.25}).dot_flops == steps / 4 * 2 * m * k * k


def test_a_scanned_layer_moves_its_own_slice_of_stacked_weights_not_the_whole_stack():
    """A scan over stacked weights reads one layer's slice per iteration, and the backward pass writes each layer's
    gradient into its slot of the stacked gradient in place: the traffic grows with the layers' bytes once, not
    with the stack's bytes once per layer (what counting whole operands gave: layers x the stack)."""
    m, k = 8, 256

    def loss(ws, x):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0].sum()

    def traffic(layers: int) -> float:
        compiled = jax.jit(jax.grad(loss)).lower(jnp.ones((layers, k, k)), jnp.ones((m, k))).compile()
        return analyze(compiled.as_text(), 1).memory_bytes

    layer = k * k * 4  # bytes of one layer's f32 weights
    eight, sixteen = traffic(8), traffic(16)
    assert sixteen / eight < 2.1  # linear in the layers (the whole stack per layer made it quadratic: 3.6x)
    assert (sixteen - eight) / 8 < 12 * layer  # XLA:CPU's slice copies, the matmuls, the update: ~11 passes


def test_a_named_switch_under_a_gradient_counts_the_branches_its_shares_give():
    """cuDNN attention's kernel choice (cudnn.py): a three-way switch, named under a scope that jax prints inside
    its transformations' names (`jvp(scope)`, `transpose(jvp(scope))`); shares (1.0,) price the first branch only,
    forward and backward."""
    m, k = 16, 32

    def loss(w, x, i):
        with jax.named_scope("kernel_choice"):
            branches = [lambda w: x @ w, lambda w: jnp.tanh(x @ w) @ w, lambda w: (x @ w) @ w @ w]
            return jax.lax.switch(i, branches, w).sum()

    compiled = jax.jit(jax.grad(loss)).lower(jnp.ones((k, k)), jnp.ones((m, k)), 0).compile()
    assert "jvp(kernel_choice)" in compiled.as_text()
    every, first = (analyze(compiled.as_text(), 1, runs) for runs in ({}, {"kernel_choice": (1.0,)}))
    assert first.dot_flops == 2 * m * k * k  # the first branch's gradient: x^T . ones, one [k, m] x [m, k] matmul
    assert every.dot_flops > 5 * first.dot_flops


def test_an_operation_named_under_a_work_share_counts_that_share_of_its_work():
    """Context parallelism's prefix kernel (context_parallel.py): its compiled shape is the whole gathered sequence,
    padded past what it uses; a work share prices the part that runs, forward and backward, and leaves the
    operations outside the scope whole."""
    m, k = 16, 32

    def loss(w, x):
        with jax.named_scope("padded"):
            y = x @ w
        return (y @ w).sum()

    compiled = jax.jit(jax.grad(loss)).lower(jnp.ones((k, k)), jnp.ones((m, k))).compile()
    whole, shared = (analyze(compiled.as_text(), 1, work_shares=shares) for shares in ({}, {"padded": 0.25}))
    outside = analyze(compiled.as_text(), 1, work_shares={"elsewhere": 0.25})
    assert outside.dot_flops == whole.dot_flops and outside.memory_bytes == whole.memory_bytes
    # Four [m, k] x [k, k]-sized matmuls, two under the scope (x @ w and its weight gradient x^T . dy): 2 + 2 / 4.
    assert (whole.dot_flops, shared.dot_flops) == (4 * 2 * m * k * k, 2.5 * 2 * m * k * k)
    assert shared.memory_bytes < whole.memory_bytes


@pytest.fixture
def mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def test_sharded_input_replicated_output_all_gathers(mesh):
    x = jax.device_put(np.ones(8 * 128, np.float32), NamedSharding(mesh, P("x")))
    f = jax.jit(lambda v: jnp.sin(v) * 2, out_shardings=NamedSharding(mesh, P()))
    stats = analyze(f.lower(x).compile().as_text(), num_devices=8)
    gather = stats.collectives["all-gather"]
    assert gather.count == 1 and gather.buffer_bytes == 8 * 128 * 4
    assert gather.moved_bytes == pytest.approx(7 / 8 * 8 * 128 * 4)
    assert stats.collectives["all-reduce"].count == 0


def test_shard_map_psum_all_reduces(mesh):
    psum = jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    x = jax.device_put(np.ones(8 * 1024, np.float32), NamedSharding(mesh, P("x")))
    stats = analyze(jax.jit(psum).lower(x).compile().as_text(), num_devices=8)
    reduce = stats.collectives["all-reduce"]
    assert reduce.count == 1 and reduce.buffer_bytes == 1024 * 4
    assert reduce.moved_bytes == pytest.approx(2 * 7 / 8 * 4096)
    assert stats.collectives["all-gather"].count == 0


def test_operations_give_each_scheduled_instruction_its_flops_and_traffic():
    # Per trip: the fusion (its body's dot; reads x and w, writes the product) and the all-gather;
    # then the entry's copy. Parameters, constants, tuples and the while itself move nothing, and the
    # fusion body's own instructions are inside the fusion's kernel, not separate operations.
    text = module(FUSED_DOT, loop_computations("body"), loop_entry(while_line("loop", "body", "3")))
    stats = analyze(text, num_devices=8)
    fusion = (DOT_FLOPS, 16 * 8 * 4 + 16 * 32 * 4 + 32 * 8 * 4)
    gather = (0.0, 256 * 4 + 32 * 8 * 4)
    copy = (0.0, 2 * 16 * 32 * 4)
    assert sorted(stats.operations) == sorted(
        [(3 * fusion[0], 3 * fusion[1], 0.0), (0.0, 3 * gather[1], 0.0), (*copy, 0.0)]
    )  # no fp8 matmul
    assert stats.memory_bytes == 3 * fusion[1] + 3 * gather[1] + copy[1]
    # Roofline: the fusion is bound by whichever of its FLOPs and bytes takes longer.
    for flops_per_s, bytes_per_s in ((1e9, 1e12), (1e12, 1e9)):
        expected = 3 * max(fusion[0] / flops_per_s, fusion[1] / bytes_per_s) + (3 * gather[1] + copy[1]) / bytes_per_s
        assert roofline_seconds(stats.operations, flops_per_s, bytes_per_s) == pytest.approx(expected)


def test_fp8_dots_are_counted_apart_and_priced_at_the_fp8_rate():
    """A dot of f8e4m3fn x f8e5m2 operands (model.fp8's weight gradient, before XLA:GPU rewrites it to cuBLASLt) in
    a fusion is an fp8 matmul; a bf16 dot next to it is not, nor is one of mixed fp8 x bf16 operands."""
    fused = """%fp8_fusion (p0: f8e4m3fn[16,32], p1: f8e5m2[32,8]) -> f32[16,8] {
  %p0 = f8e4m3fn[16,32]{1,0} parameter(0)
  %p1 = f8e5m2[32,8]{1,0} parameter(1)
  ROOT %dot = f32[16,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    text = module(
        fused,
        entry(
            "%x8 = f8e4m3fn[16,32]{1,0} parameter(2)",
            "%g8 = f8e5m2[32,8]{1,0} parameter(3)",
            "%x = bf16[16,32]{1,0} parameter(4)",
            "%w = bf16[32,8]{1,0} parameter(5)",
            "%f = f32[16,8]{1,0} fusion(%x8, %g8), kind=kOutput, calls=%fp8_fusion",
            "%d = bf16[16,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            "%m = bf16[16,8]{1,0} dot(%x8, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        ),
    )
    stats = analyze(text, num_devices=1)
    flops = 2 * 16 * 8 * 32
    assert stats.dot_flops == 3 * flops and stats.fp8_flops == flops
    assert sorted(op[::2] for op in stats.operations if op[0]) == [(flops, 0.0), (flops, 0.0), (flops, flops)]
    # Bound by arithmetic: two bf16 matmuls at 1 FLOP/s, the fp8 one at 2; without an fp8 rate, all three at 1.
    assert roofline_seconds(stats.operations, 1.0, 1e30, 2.0) == pytest.approx(2 * flops + flops / 2)
    assert roofline_seconds(stats.operations, 1.0, 1e30) == pytest.approx(3 * flops)
    assert roofline_seconds([(10.0, 1.0)], 1.0, 1e30, 2.0) == 10.0  # (flops, bytes) alone: no fp8 FLOPs


# ---------------------------------------------------------------------------------------------
# GPU library calls, in the form XLA:GPU prints them after compilation (compiled.as_text()): cuBLAS(Lt)
# GEMMs as in XLA's own compiler tests, cuDNN attention with the backend_config jax 0.10.2 and 0.12 emit
# for llama_jax/cudnn.py's call (lowered for CUDA: causal, BTNH, 8 query heads over 2 K/V heads).


def strings(dims) -> str:
    return ",".join(f'"{d}"' for d in dims)


def dot_numbers(lhs_contracting, rhs_contracting, lhs_batch=(), rhs_batch=()) -> str:
    return (
        f'{{"lhs_contracting_dimensions":[{strings(lhs_contracting)}],'
        f'"rhs_contracting_dimensions":[{strings(rhs_contracting)}],'
        f'"lhs_batch_dimensions":[{strings(lhs_batch)}],"rhs_batch_dimensions":[{strings(rhs_batch)}]}}'
    )


def gemm_config(*numbers, epilogue="DEFAULT", damax=False) -> str:
    return (
        '{"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{"alpha_real":1,"beta":0,'
        f'"dot_dimension_numbers":{dot_numbers(*numbers)},"alpha_imag":0,'
        '"precision_config":{"operand_precision":["DEFAULT","DEFAULT"],"algorithm":"ALG_UNSET"},'
        f'"epilogue":"{epilogue}","grad_x":false,"grad_y":false,"damax_output":{str(damax).lower()}}},'
        '"force_earliest_schedule":false,"reification_cost":[]}'
    )


GEMMS = {
    # XLA's NVPTX compiler test: the lhs contracts its dim 0, the rhs its dim 1
    "gemm": (
        [
            "%lhs = bf16[3072,512]{1,0} parameter(2)",
            "%rhs = bf16[3840,3072]{1,0} parameter(3)",
            "%gemm = (bf16[512,3840]{0,1}, s8[26738688]{0}) custom-call(%lhs, %rhs), "
            f'custom_call_target="__cublas$gemm", backend_config={gemm_config([0], [1])}',
        ],
        2 * 512 * 3840 * 3072,
        2 * (3072 * 512 + 3840 * 3072 + 512 * 3840),
    ),
    # batch dim 0; operands printed with their shapes, as older XLA does
    "batched": (
        [
            "%a = f32[4,16,32]{2,1,0} parameter(2)",
            "%b = f32[4,32,8]{2,1,0} parameter(3)",
            "%gemm = (f32[4,16,8]{2,1,0}, s8[4194304]{0}) custom-call(f32[4,16,32]{2,1,0} %a, "
            'f32[4,32,8]{2,1,0} %b), custom_call_target="__cublas$gemm", '
            f"backend_config={gemm_config([2], [1], [0], [0])}",
        ],
        2 * 4 * 16 * 8 * 32,
        4 * (4 * 16 * 32 + 4 * 32 * 8 + 4 * 16 * 8),
    ),
    "lt bias+gelu": (
        [
            "%x = bf16[256,1024]{1,0} parameter(2)",
            "%w = bf16[1024,4096]{1,0} parameter(3)",
            "%bias = bf16[4096]{0} parameter(4)",
            "%gemm = (bf16[256,4096]{1,0}, s8[33554432]{0}) custom-call(%x, %w, %bias), "
            'custom_call_target="__cublas$lt$matmul", '
            f"backend_config={gemm_config([1], [0], epilogue='BIAS_GELU')}",
        ],
        2 * 256 * 4096 * 1024,
        2 * (256 * 1024 + 1024 * 4096 + 4096 + 256 * 4096),
    ),
    # fp8: four f32 scales in, (output, amax, workspace) out
    "lt f8 amax": (
        [
            "%a = f8e4m3fn[128,512]{1,0} parameter(2)",
            "%b = f8e4m3fn[256,512]{1,0} parameter(3)",
            "%one = f32[] constant(1)",
            "%gemm = (f8e4m3fn[128,256]{1,0}, f32[], s8[33554432]{0}) "
            "custom-call(%a, %b, %one, %one, %one, %one), "
            f'custom_call_target="__cublas$lt$matmul$f8", backend_config={gemm_config([1], [1], damax=True)}',
        ],
        2 * 128 * 256 * 512,
        128 * 512 + 256 * 512 + 4 * 4 + 128 * 256 + 4,
    ),
}


@pytest.mark.parametrize("lines, flops, traffic", GEMMS.values(), ids=GEMMS.keys())
def test_cublas_gemms_count_as_matmuls_and_their_workspace_is_not_traffic(lines, flops, traffic):
    stats = analyze(module(entry(*lines)), num_devices=1)
    assert stats.dot_flops == flops
    # operands + output (+ amax); the s8 workspace is scratch. cuBLASLt's fp8 GEMM: every FLOP an fp8 one.
    fp8 = flops if "$f8" in lines[-1] else 0.0
    assert (flops, traffic, fp8) in stats.operations and stats.fp8_flops == fp8


B, T, H, KV, D = 2, 1024, 8, 2, 64
CAUSAL_PAIRS = T * (T + 1) // 2  # query i sees keys 0..i
# jax's dot dimension numbers for the BTNH layout (llama_jax/cudnn.py) and for BNTH.
FORWARD = {
    "BTNH": {"bmm1": ([3], [3], [0, 2], [0, 2]), "bmm2": ([3], [1], [0, 1], [0, 2])},
    "BNTH": {"bmm1": ([3], [3], [0, 1], [0, 1]), "bmm2": ([3], [2], [0, 1], [0, 1])},
}
BACKWARD = {
    "BTNH": {
        "bmm1_grad_gemm1": ([2], [1], [0, 1], [0, 2]),
        "bmm1_grad_gemm2": ([3], [1], [0, 1], [0, 2]),
        "bmm2_grad_gemm1": ([2], [1], [0, 1], [0, 2]),
        "bmm2_grad_gemm2": ([3], [3], [0, 2], [0, 2]),
    },
    "BNTH": {
        "bmm1_grad_gemm1": ([2], [2], [0, 1], [0, 1]),
        "bmm1_grad_gemm2": ([3], [2], [0, 1], [0, 1]),
        "bmm2_grad_gemm1": ([2], [2], [0, 1], [0, 1]),
        "bmm2_grad_gemm2": ([3], [3], [0, 1], [0, 1]),
    },
}
SHAPES = {
    "BTNH": (f"bf16[{B},{T},{H},{D}]{{3,2,1,0}}", f"bf16[{B},{T},{KV},{D}]{{3,2,1,0}}"),
    "BNTH": (f"bf16[{B},{H},{T},{D}]{{3,2,1,0}}", f"bf16[{B},{KV},{T},{D}]{{3,2,1,0}}"),
}


def fmha_config(numbers: dict, mask: str = "CAUSAL", window: int = 0) -> str:
    bmms = ",".join(f'"{name}_dot_dimension_numbers":{dot_numbers(*n)}' for name, n in numbers.items())
    return (
        '{"operation_queue_id":"0","wait_on_operation_queues":[],"cudnn_fmha_backend_config":{"algorithm":'
        '{"algo_id":"0","math_type":"TENSOR_OP_MATH","tuning_knobs":{"17":"1","24":"0"},"is_cudnn_frontend":true,'
        '"workspace_size":"0"},"fmha_scale":0.125,"intermediate_tensor_shape":{"element_type":"BF16",'
        f'"dimensions":[{strings([B, H, T, T])}],"tuple_shapes":[],"layout":{{"dim_level_types":[],"dim_unique":[],'
        '"dim_ordered":[],"minor_to_major":["3","2","1","0"],"tiles":[],"element_size_in_bits":"0",'
        '"memory_space":"0",'
        '"index_primitive_type":"PRIMITIVE_TYPE_INVALID","pointer_primitive_type":"PRIMITIVE_TYPE_INVALID",'
        '"dynamic_shape_metadata_prefix_bytes":"0"},"is_dynamic_dimension":[false,false,false,false]},'
        f'"is_flash_attention":true,"mask_type":"{mask}",{bmms},"dropout_rate":0.0,"seed":42,'
        f'"sliding_window_length":{window},"max_seg_per_batch":1,"is_paged_attention":false}},'
        '"force_earliest_schedule":false,"reification_cost":[]}'
    )


def fmha_forward(q: str, k: str, v: str, layout: str = "BTNH", mask: str = "CAUSAL", window: int = 0) -> str:
    qs, ks = SHAPES[layout]
    return (
        f"%fwd.{q} = (bf16[{B},{H},{T},{D}]{{3,1,2,0}}, f32[{B},{H},{T}]{{2,1,0}}, u8[0]{{0}}) "
        f'custom-call(%{q}, %{k}, %{v}), custom_call_target="__cudnn$fmhaSoftmax", '
        f"operand_layout_constraints={{{qs}, {ks}, {ks}}}, api_version=API_VERSION_STATUS_RETURNING, "
        'metadata={op_name="jit(loss)/dot_product_attention_fwd" stack_frame_id=7}, '
        f"backend_config={fmha_config(FORWARD[layout], mask, window)}"
    )


def fmha_backward(q: str, k: str, v: str, stats: str, grad: str, out: str, layout: str = "BTNH") -> str:
    qs, ks = SHAPES[layout]
    return (
        f"%bwd.{q} = (bf16[{B},{H},{T},{D}]{{3,1,2,0}}, bf16[{B},{KV},{T},{D}]{{3,1,2,0}}, "
        f"bf16[{B},{KV},{T},{D}]{{3,1,2,0}}, u8[4194304]{{0}}) "
        f"custom-call(%{q}, %{k}, %{v}, %{stats}, %{grad}, %{out}), "
        f'custom_call_target="__cudnn$fmhaSoftmaxBackward", operand_layout_constraints={{{qs}, {ks}, {ks}, '
        f"f32[{B},{H},{T}]{{2,1,0}}, {qs}, {qs}}}, api_version=API_VERSION_STATUS_RETURNING, "
        f"backend_config={fmha_config(BACKWARD[layout])}"
    )


def attention_operands(layout: str = "BTNH") -> list[str]:
    qs, ks = SHAPES[layout]
    return [
        f"%q = {qs} parameter(2)",
        f"%k = {ks} parameter(3)",
        f"%v = {ks} parameter(4)",
        f"%stats = f32[{B},{H},{T}]{{2,1,0}} parameter(5)",
        f"%do = {qs} parameter(6)",
        f"%o = {qs} parameter(7)",
    ]


@pytest.mark.parametrize(
    "mask, window, pairs",
    [
        ("CAUSAL", 0, CAUSAL_PAIRS),
        ("PADDING_CAUSAL", 0, CAUSAL_PAIRS),
        ("NO_MASK", 0, T * T),
        ("PADDING", 0, T * T),
        ("CAUSAL", 256, sum(min(i + 1, 256) for i in range(T))),  # each query sees its 256 latest keys
    ],
)
def test_cudnn_attention_forward_counts_its_two_matmuls_over_the_visible_pairs(mask, window, pairs):
    text = module(entry(*attention_operands(), fmha_forward("q", "k", "v", mask=mask, window=window)))
    stats = analyze(text, num_devices=1)
    flops = 2 * (2 * B * H * pairs * D)  # S = Q·Kᵀ and O = P·V, for all 8 query heads
    assert stats.dot_flops == flops
    traffic = 2 * B * T * (H + 2 * KV) * D + 2 * B * H * T * D + 4 * B * H * T  # reads Q, K, V; writes O, stats
    assert (flops, traffic, 0.0) in stats.operations


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_cudnn_attention_backward_recomputes_scores(layout):
    operands = attention_operands(layout)
    fwd = analyze(module(entry(*operands, fmha_forward("q", "k", "v", layout))), num_devices=1)
    bwd = analyze(module(entry(*operands, fmha_backward("q", "k", "v", "stats", "do", "o", layout))), num_devices=1)
    assert fwd.dot_flops == 4 * B * H * CAUSAL_PAIRS * D
    assert bwd.dot_flops == 2 * 5 * B * H * CAUSAL_PAIRS * D  # S again, then dP, dV, dQ, dK
    # Reads Q, K, V, stats, dO, O; writes dQ, dK, dV; the u8 workspace is scratch.
    traffic = 2 * B * T * (H + 2 * KV) * D + 4 * B * H * T + 2 * 2 * B * H * T * D + 2 * B * T * (H + 2 * KV) * D
    assert (bwd.dot_flops, traffic, 0.0) in bwd.operations


LAYER = (
    f"(s32[], bf16[{B},{T},{H},{D}]{{3,2,1,0}}, bf16[{B},{T},{KV},{D}]{{3,2,1,0}}, bf16[2048,512]{{1,0}}, "
    "bf16[512,512]{1,0})"
)


def test_scanned_layers_multiply_library_calls():
    body = f"""%layer (carry: {LAYER}) -> {LAYER} {{
  %carry = {LAYER} parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %q = bf16[{B},{T},{H},{D}]{{3,2,1,0}} get-tuple-element(%carry), index=1
  %k = bf16[{B},{T},{KV},{D}]{{3,2,1,0}} get-tuple-element(%carry), index=2
  %x = bf16[2048,512]{{1,0}} get-tuple-element(%carry), index=3
  %w = bf16[512,512]{{1,0}} get-tuple-element(%carry), index=4
  %mm = (bf16[2048,512]{{1,0}}, s8[4194304]{{0}}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", \
backend_config={gemm_config([1], [0])}
  %y = bf16[2048,512]{{1,0}} get-tuple-element(%mm), index=0
  {fmha_forward("q", "k", "k")}
  %stats = f32[{B},{H},{T}]{{2,1,0}} get-tuple-element(%fwd.q), index=1
  {fmha_backward("q", "k", "k", "stats", "q", "q")}
  ROOT %next = {LAYER} tuple(%i, %q, %k, %y, %w)
}}

%layer_cond (c: {LAYER}) -> pred[] {{
  %c = {LAYER} parameter(0)
  ROOT %go = pred[] constant(true)
}}
"""
    main = f"""ENTRY %main (init: {LAYER}) -> {LAYER} {{
  %init = {LAYER} parameter(0)
  ROOT %layers = {LAYER} while(%init), condition=%layer_cond, body=%layer, \
backend_config={{"known_trip_count":{{"n":"4"}}}}
}}
"""
    stats = analyze(module(body, main), num_devices=1)
    per_layer = 2 * 2048 * 512 * 512 + (4 + 10) * B * H * CAUSAL_PAIRS * D
    assert stats.dot_flops == 4 * per_layer
    assert sum(op[0] for op in stats.operations) == 4 * per_layer
    assert stats.unknown_trip_counts == 0


def test_gemm_inside_a_fusion_counts_once():
    # XLA:GPU's dynamic-slice fusion runs a cuBLAS call on slices of its operands.
    fused = f"""%dynamic-slice-fusion (p0: bf16[2,8,8], p1: bf16[2,8,8]) -> (bf16[8,8], s8[256]) {{
  %p0 = bf16[2,8,8]{{2,1,0}} parameter(0)
  %p1 = bf16[2,8,8]{{2,1,0}} parameter(1)
  %slice.13 = bf16[1,8,8]{{2,1,0}} slice(%p0), slice={{[1:2], [0:8], [0:8]}}
  %bitcast.41 = bf16[8,8]{{1,0}} bitcast(%slice.13)
  %slice.14 = bf16[1,8,8]{{2,1,0}} slice(%p1), slice={{[1:2], [0:8], [0:8]}}
  %bitcast.42 = bf16[8,8]{{1,0}} bitcast(%slice.14)
  ROOT %custom-call.1 = (bf16[8,8]{{1,0}}, s8[256]{{0}}) custom-call(%bitcast.41, %bitcast.42), \
custom_call_target="__cublas$gemm", backend_config={gemm_config([1], [0])}
}}
"""
    text = module(
        fused,
        entry(
            "%a = bf16[2,8,8]{2,1,0} parameter(2)",
            "%b = bf16[2,8,8]{2,1,0} parameter(3)",
            "%address_computation = (bf16[8,8]{1,0}, s8[256]{0}) fusion(%a, %b), kind=kCustom, "
            'calls=%dynamic-slice-fusion, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],'
            '"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":'
            '{"name":"dynamic_address_computation"}},"force_earliest_schedule":false}',
        ),
    )
    stats = analyze(text, num_devices=1)
    assert stats.dot_flops == 2 * 8 * 8 * 8
    assert [op[0] for op in stats.operations if op[0]] == [2 * 8 * 8 * 8]


# --------------------------------------------------------------------------------------------
# Device groups: which devices each collective runs over (costmodel.py maps them to mesh axes and hosts)


def _iota_groups(groups: int, size: int, dims: tuple, perm: tuple) -> tuple:
    return tuple(map(tuple, np.arange(np.prod(dims)).reshape(dims).transpose(perm).reshape(groups, size).tolist()))


@pytest.mark.parametrize(
    "groups, expected",
    [
        ("{{0,2},{1,3},{4,6},{5,7}}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("{}", (tuple(range(8)),)),
        ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("[4,2]<=[2,4]T(1,0)", _iota_groups(4, 2, (2, 4), (1, 0))),
        ("[2,4]<=[2,2,2]T(2,0,1)", _iota_groups(2, 4, (2, 2, 2), (2, 0, 1))),
        # mesh form: devices 0..7 row-major over the mesh; a group varies the listed axes only
        ("mesh['a'=4,'b'=2] {'a'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("mesh['a'=4,'b'=2] {'b'}", ((0, 1), (2, 3), (4, 5), (6, 7))),
        ("mesh['a'=4,'b'=2] {'a','b'}", (tuple(range(8)),)),
        # sub-axes: 'x':(2)2 is the middle part of x=8 split major to minor as 2 x 2 x 2
        ("mesh['x'=8] {'x':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("mesh['x'=2,'y'=4] {'y':(1)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        # a mesh over a permuted device order (XLA's Mesh::ToString adds device_ids when not iota)
        ("mesh['a'=2,'b'=4], device_ids=(3,6,0,5,1,7,2,4) {'b'}", ((3, 6, 0, 5), (1, 7, 2, 4))),
    ],
)
def test_collectives_keep_their_device_groups(groups, expected):
    line = f"%c = f32[64]{{0}} all-reduce(%p), replica_groups={groups}, to_apply=%add"
    stats = analyze(module(ADD, entry(line)), num_devices=8)
    n = len(expected[0])
    assert stats.collective_groups == {("all-reduce", expected): pytest.approx(2 * (n - 1) / n * 256)}
    assert stats.collectives["all-reduce"].moved_bytes == pytest.approx(2 * (n - 1) / n * 256)


def test_a_permute_groups_its_pairs_and_each_kind_sums_its_groups():
    text = module(
        ADD,
        entry(
            "%cp = f32[32]{0} collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
            "%a1 = f32[64]{0} all-gather(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}",
            "%a2 = f32[64]{0} all-gather(%p), replica_groups=[2,4]<=[8], dimensions={0}",
            "%a3 = f32[64]{0} all-gather(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}",
        ),
    )
    stats = analyze(text, num_devices=8)
    pairs = ((0, 1), (1, 2), (2, 3), (3, 0))
    assert stats.collective_groups == {
        ("collective-permute", pairs): 128.0,
        ("all-gather", ((0, 1), (2, 3), (4, 5), (6, 7))): pytest.approx(2 * 256 / 2),  # the same groups add up
        ("all-gather", ((0, 1, 2, 3), (4, 5, 6, 7))): pytest.approx(256 * 3 / 4),
    }
    for kind, c in stats.collectives.items():
        assert sum(b for (k, _), b in stats.collective_groups.items() if k == kind) == pytest.approx(c.moved_bytes)


def test_compiled_groups_are_positions_in_the_mesh_device_order():
    """XLA numbers an SPMD program's devices by their place in the mesh, not by device id: on a mesh over a
    permuted device list, a psum over 'b' groups positions 0-3 and 4-7."""
    devices = np.array(jax.devices())[[3, 6, 0, 5, 1, 7, 2, 4]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("a", "b"))
    psum = jax.shard_map(
        lambda v: jax.lax.psum(v, "b"), mesh=mesh, in_specs=P("a", "b"), out_specs=P("a"), check_vma=False
    )
    x = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("a", "b")))
    stats = analyze(jax.jit(psum).lower(x).compile().as_text(), num_devices=8)
    assert [groups for kind, groups in stats.collective_groups if kind == "all-reduce"] == [
        ((0, 1, 2, 3), (4, 5, 6, 7))
    ]
