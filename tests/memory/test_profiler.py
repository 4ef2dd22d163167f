"""Profile pooling: times of layers that do the same work become their class's median."""

import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from leanml.memory.costs import (
    CompiledStat,
    CompressStat,
    GroupStats,
    Profile,
    copy_unmeasured,
    copy_unmeasured_compiled,
    layer_classes,
    pool_timings,
)
from leanml.memory.profiler import ProfileOptions, profile_step
from leanml.memory.structure import GroupKey, find_blocks

from .test_runtime import IDS


def _synthetic(times: list[float], layer_bytes: list[int]) -> Profile:
    """One ``mlp`` group per layer with the given forward times and bytes, compiled stats at two budgets."""
    groups = {}
    compiled = {}
    for i, (t, b) in enumerate(zip(times, layer_bytes, strict=True)):
        g = GroupStats(i, "mlp", "mlp", bytes=b, fwd_s=t, sel_recompute_s=t / 2)
        g.compress = {"bf16": CompressStat(b // 2, t / 10, t / 20, 0.001 * (i + 1), b)}
        groups[g.key] = g
        compiled[i] = [CompiledStat(1.0, b, b, -t / 4, 1.0, {"bf16": CompressStat(b // 2, t / 5, t / 5, 0.002, b)}),
                       CompiledStat(0.5, b // 2, b, -t / 8, 1.0)]
    n = len(times)
    return Profile(groups, n, [100] * n, list(times), sum(layer_bytes), ("bf16",), compiled=compiled,
                   layer_eager_s=[2 * t for t in times], measured_layers=list(range(n)),
                   layer_kinds=["Block"] * n)


def test_pooling_takes_the_class_median_and_keeps_bytes() -> None:
    times = [1.0, 5.0, 2.0, 3.0, 0.5]
    prof = _synthetic(times, [64, 64, 64, 64, 32])  # the last layer saves less: a class of its own
    assert layer_classes(prof) == [[0, 1, 2, 3], [4]]
    pooled = pool_timings(prof)
    med = statistics.median(times[:4])  # 2.5, computed independently of the pooling code
    for i in range(4):
        g = pooled.groups[GroupKey(i, "mlp")]
        assert g.fwd_s == med and g.sel_recompute_s == statistics.median([t / 2 for t in times[:4]])
        assert g.bytes == 64 and g.compress["bf16"].payload_bytes == 32
        assert g.compress["bf16"].pack_s == statistics.median([t / 10 for t in times[:4]])
        assert g.compress["bf16"].error == 0.004  # the largest error in the class, not a median
        assert pooled.layer_fwd_s[i] == med and pooled.layer_eager_s[i] == 2 * med
        c1, c05 = pooled.compiled[i]
        assert c1.time_s == statistics.median([-t / 4 for t in times[:4]])
        assert c05.time_s == statistics.median([-t / 8 for t in times[:4]])
        assert c1.compress["bf16"].unpack_s == statistics.median([t / 5 for t in times[:4]])
    # a class of one keeps its own times; the input profile is left as it was
    assert pooled.groups[GroupKey(4, "mlp")].fwd_s == 0.5 and pooled.compiled[4][0].time_s == -0.125
    assert [prof.groups[GroupKey(i, "mlp")].fwd_s for i in range(5)] == times
    assert [prof.compiled[i][0].time_s for i in range(5)] == [-t / 4 for t in times]


def test_pooling_uses_only_measured_layers() -> None:
    times = [1.0, 9.0, 3.0, 9.0]
    prof = _synthetic(times, [64] * 4)
    prof.measured_layers = [0, 2]  # layers 1 and 3 copied stats (here: made-up outliers) from neighbours
    pooled = pool_timings(prof)
    assert all(pooled.groups[GroupKey(i, "mlp")].fwd_s == 2.0 for i in range(4))
    assert all(pooled.compiled[i][0].time_s == -0.5 for i in range(4))


def test_pooling_a_real_profile() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).train()
    model.config.use_cache = False
    prof = profile_step(model, find_blocks(model), lambda: model(input_ids=IDS, labels=IDS).loss,
                        ProfileOptions(compress_layers=[0, 2]))
    assert prof.measured_layers == [0, 2] and prof.layer_kinds == ["LlamaDecoderLayer"] * 4
    classes = layer_classes(prof)
    # the later layers do the same work (the first also owns the tensors every layer receives, e.g. rotary cos/sin)
    assert sorted(sum(classes, [])) == [0, 1, 2, 3] and any({1, 2} <= set(c) for c in classes)
    pooled = pool_timings(prof)
    for cls in classes:
        ref = [i for i in cls if i in (0, 2)] or cls
        for child in {g.child for g in prof.layer_groups(cls[0])}:
            want = statistics.median([prof.groups[GroupKey(i, child)].fwd_s for i in ref])
            assert all(pooled.groups[GroupKey(i, child)].fwd_s == want for i in cls)
            assert all(pooled.groups[GroupKey(i, child)].bytes == prof.groups[GroupKey(i, child)].bytes for i in cls)
    assert pooled.peak_bytes == prof.peak_bytes


def test_unmeasured_layers_copy_the_nearest_measured_one_scaled_by_bytes() -> None:
    """Layer 1 (not measured, twice layer 0's bytes) and layer 3 (nearest: layer 2) copy compressor and
    compiled stats scaled by bytes; errors and the largest output stay as measured."""
    groups = {}
    for i, b in enumerate([100, 200, 400, 400]):
        g = GroupStats(i, "mlp", "mlp", bytes=b, outlier_ratio=float(i + 1))
        if i in (0, 2):
            g.compress = {"bf16": CompressStat(b // 2, 0.01 * (i + 1), 0.02 * (i + 1), 0.001 * (i + 1), b)}
        groups[g.key] = g
    copy_unmeasured(groups, {0, 2})
    assert groups[GroupKey(1, "mlp")].compress["bf16"] == CompressStat(100, 0.02, 0.04, 0.001, 100)
    assert groups[GroupKey(1, "mlp")].outlier_ratio == 1.0
    assert groups[GroupKey(3, "mlp")].compress["bf16"] == CompressStat(200, 0.03, 0.06, 0.003, 400)
    compiled = {0: [CompiledStat(0.5, 80, 40, -0.1, 2.0, {"bf16": CompressStat(40, 0.01, 0.01, 0.002, 40)})]}
    eager = [1.0, 0.0, 0.0, 0.0]
    copy_unmeasured_compiled(compiled, eager, 4, groups)
    assert eager == [1.0, 2.0, 4.0, 4.0]
    assert compiled[2] == [CompiledStat(0.5, 320, 40, -0.4, 0.0, {"bf16": CompressStat(160, 0.04, 0.04, 0.002, 40)})]
