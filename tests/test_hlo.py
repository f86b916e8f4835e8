"""Tests for llama_jax.hlo: hand-written HLO snippets plus a few real compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from llama_jax.hlo import KINDS, analyze, roofline_seconds, shape_bytes

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
    return f"ENTRY %main (p: f32[128], s: f32[]) -> f32[] {{\n  %p = f32[128]{{0}} parameter(0)\n" \
           f"  %s = f32[] parameter(1)\n{body}\n  ROOT %r = f32[] copy(%s)\n}}\n"


@pytest.mark.parametrize("shape, expected", [
    ("f32[]", 4), ("s32[]", 4), ("pred[3]", 3), ("f32[32,128]{1,0}", 32 * 128 * 4), ("bf16[2,3]{1,0}", 12),
    ("f8e4m3fn[10]", 10), ("c64[2]", 16), ("token[]", 0), ("u64[2]", 16),
    ("(f32[], bf16[2,3])", 16),
    ("(f32[], f32[320,64]{1,0}, s8[1], u8[1], /*index=4*/f16[2]{0})", 4 + 81920 + 2 + 4),
    ("((f32[2]{0}, s32[]), /*index=1*/f64[1])", 8 + 4 + 8), ("f32[<=10]{0}", 40),
])
def test_shape_bytes(shape, expected):
    assert shape_bytes(shape) == expected


def test_shape_bytes_rejects_unknown_dtype():
    with pytest.raises(ValueError):
        shape_bytes("q7[3]")


@pytest.mark.parametrize("line, kind, buffer, moved", [
    # mesh form: the group is the product of the listed axes
    ("%c = f32[1024]{0} all-gather(%p), channel_id=1, replica_groups=mesh['x'=4,'y'=2] {'x','y'}, "
     "dimensions={0}, use_global_device_ids=true", "all-gather", 4096, 4096 * 7 / 8),
    ("%c = f32[256]{0} all-gather(%p), replica_groups=mesh['x'=4,'y'=2] {'y'}, dimensions={0}",
     "all-gather", 1024, 1024 / 2),
    # a sub-axis (jax >= 0.11, Shardy): 'tensor':(1)2 is a part of size 2 of the axis of 8
    ("%c = f32[8,32,2,8]{3,1,0,2} all-gather(%p), channel_id=12, replica_groups=mesh['data'=1,'fsdp'=1,"
     "'sequence'=1,'tensor'=8] {'tensor':(1)2}, dimensions={2}, use_global_device_ids=true",
     "all-gather", 16384, 16384 / 2),
    ("%c = f32[64]{0} all-reduce(%p), replica_groups=mesh['x'=2,'y'=8] {'x','y':(2)4}, to_apply=%add",
     "all-reduce", 256, 2 * 7 / 8 * 256),
    # explicit groups: size of the first group
    ("%c = f32[128]{0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add",
     "all-reduce", 512, 2 * 3 / 4 * 512),
    # iota forms: the last dim of the first bracket
    ("%c = f32[16]{0} reduce-scatter(%p), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add",
     "reduce-scatter", 64, 3 * 64),
    ("%c = f32[128]{0} all-to-all(%p), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}",
     "all-to-all", 512, 512 / 2),
    # empty groups: all num_devices (8) devices
    ("%c = f32[128]{0} all-reduce(%p), channel_id=3, replica_groups={}, to_apply=%add",
     "all-reduce", 512, 2 * 7 / 8 * 512),
    # groups of one move nothing
    ("%c = f32[128]{0} all-reduce(%p), replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add",
     "all-reduce", 512, 0.0),
    ("%c = f32[128]{0} collective-permute(%p), channel_id=4, source_target_pairs={{0,1},{1,0}}",
     "collective-permute", 512, 512.0),
    # tuple results (a combined all-reduce) sum all their elements
    ("%c = (f32[], /*index=1*/f32[128]{0}) all-reduce(%s, %p), replica_groups={}, to_apply=%add",
     "all-reduce", 516, 2 * 7 / 8 * 516),
])
def test_collective_forms(line, kind, buffer, moved):
    stats = analyze(module(ADD, entry(line)), num_devices=8)
    assert set(stats.collectives) == set(KINDS)
    assert stats.collectives[kind].count == 1
    assert stats.collectives[kind].buffer_bytes == buffer
    assert stats.collectives[kind].moved_bytes == pytest.approx(moved)
    assert all(c.count == 0 for k, c in stats.collectives.items() if k != kind)
    assert stats.dot_flops == 0 and stats.unknown_trip_counts == 0


def test_async_pairs_count_the_start_and_its_output():
    text = module(ADD, entry(
        "%ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(%p), channel_id=1, replica_groups={}, "
        "dimensions={0}",
        "%agd = f32[1024]{0} all-gather-done(%ags)",
        "%ars = f32[128]{0} all-reduce-start(%p), channel_id=2, replica_groups={}, to_apply=%add",
        "%ard = f32[128]{0} all-reduce-done(%ars)",
        "%cps = (f32[128]{0}, f32[128]{0}, u32[], u32[]) collective-permute-start(%p), "
        "source_target_pairs={{0,1}}",
        "%cpd = f32[128]{0} collective-permute-done(%cps)"))
    c = analyze(text, num_devices=8).collectives
    assert (c["all-gather"].count, c["all-gather"].buffer_bytes) == (1, 4096)
    assert c["all-gather"].moved_bytes == pytest.approx(4096 * 7 / 8)
    assert (c["all-reduce"].count, c["all-reduce"].buffer_bytes) == (1, 512)
    assert (c["collective-permute"].count, c["collective-permute"].buffer_bytes) == (1, 512)


FUSED_DOT = """%fused_dot (param_0: f32[16,32], param_1: f32[32,8]) -> f32[16,8] {
  %param_0 = f32[16,32]{1,0} parameter(0)
  %param_1 = f32[32,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
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
    return f"""ENTRY %main (x: f32[16,32], w: f32[32,8]) -> f32[16,32] {{
  %x = f32[16,32]{{1,0}} parameter(0)
  %w = f32[32,8]{{1,0}} parameter(1)
  %zero = s32[] constant(0)
  %init = {LOOP} tuple(%zero, %x, %w)
""" + "\n".join("  " + line for line in lines) + "\n  ROOT %out = f32[16,32]{1,0} copy(%x)\n}\n"


def test_while_with_known_trip_count_multiplies_fused_dot_and_collectives():
    text = module(FUSED_DOT, loop_computations("body"), loop_entry(while_line("loop", "body", "3")))
    stats = analyze(text, num_devices=8)
    assert stats.dot_flops == 3 * DOT_FLOPS
    assert stats.collectives["all-gather"].count == 3
    assert stats.collectives["all-gather"].buffer_bytes == 3 * 1024
    assert stats.unknown_trip_counts == 0


def test_nested_whiles_multiply():
    inner_while = while_line("inner", "inner_body", "5").replace("%init", "%loop.outer_body")
    text = module(FUSED_DOT, loop_computations("inner_body"), loop_computations("outer_body", inner_while),
                  loop_entry(while_line("outer", "outer_body", "2")))
    stats = analyze(text, num_devices=8)
    assert stats.dot_flops == (2 + 2 * 5) * DOT_FLOPS
    assert stats.collectives["all-gather"].count == 2 + 2 * 5


def test_missing_trip_count_counts_once():
    text = module(FUSED_DOT, loop_computations("body"), loop_entry(while_line("loop", "body", "")))
    stats = analyze(text, num_devices=8)
    assert stats.unknown_trip_counts == 1
    assert stats.dot_flops == DOT_FLOPS


def test_quoted_backend_config_and_shared_callees_sum():
    line = while_line("loop", "body", "").replace(
        "body=%body", 'body=%body, backend_config="{\\"known_trip_count\\":{\\"n\\":\\"4\\"}}"')
    text = module(FUSED_DOT, loop_computations("body"), loop_entry(
        line, "%f1 = f32[16,8]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot"))
    assert analyze(text, num_devices=8).dot_flops == (4 + 1) * DOT_FLOPS


def test_dot_operand_shapes_from_header_and_conditional_branches():
    # The branch has no parameter instructions, so the lhs shape must come from its header.
    branch = """%branch (a: f32[4,6,10], b: f32[4,10,3]) -> f32[4,6,3] {
  ROOT %d = f32[4,6,3]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""
    text = module(branch, entry("%pr = pred[] constant(true)",
                                "%cd = f32[4,6,3]{2,1,0} conditional(%pr, %s, %s), true_computation=%branch, "
                                "false_computation=%branch"))
    assert analyze(text, num_devices=1).dot_flops == 2 * (2 * 4 * 6 * 3 * 10)  # both branches: upper bound


def test_convolution_flops():
    text = module(entry(
        "%img = f32[1,8,8,4]{3,2,1,0} parameter(2)", "%k = f32[3,3,4,16]{3,2,1,0} parameter(3)",
        "%conv = f32[1,8,8,16]{3,2,1,0} convolution(%img, %k), window={size=3x3 pad=1_1x1_1}, "
        "dim_labels=b01f_01io->b01f"))
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
    assert sorted(stats.operations) == sorted([(3 * fusion[0], 3 * fusion[1]), (0.0, 3 * gather[1]), copy])
    assert stats.memory_bytes == 3 * fusion[1] + 3 * gather[1] + copy[1]
    # Roofline: the fusion is bound by whichever of its FLOPs and bytes takes longer.
    for flops_per_s, bytes_per_s in ((1e9, 1e12), (1e12, 1e9)):
        expected = 3 * max(fusion[0] / flops_per_s, fusion[1] / bytes_per_s) + (3 * gather[1] + copy[1]) / bytes_per_s
        assert roofline_seconds(stats.operations, flops_per_s, bytes_per_s) == pytest.approx(expected)
