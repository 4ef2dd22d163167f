"""Runtime, meter and Adacc on tiny Hugging Face decoders (LLaMA, OPT) and a plain block stack."""

import logging

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from leanml.errors import LeanmlError
from leanml.memory import ActivationMeter, Adacc, Budget
from leanml.memory.meter import param_tensors
from leanml.memory.policy import DriftMonitor, DriftThresholds
from leanml.memory.runtime import RECOMPUTE, SELECTIVE, AppliedPlan, Compression, apply_strategy
from leanml.memory.structure import GroupKey, find_blocks

torch.set_num_threads(1)


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).train()


def tiny_opt() -> nn.Module:
    torch.manual_seed(0)
    cfg = OPTConfig(hidden_size=64, ffn_dim=160, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                    max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.1)
    return OPTForCausalLM(cfg).train()


class Block(nn.Module):
    """A plain pre-norm transformer block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Stack(nn.Module):
    def __init__(self, d: int = 64, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


IDS = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def grads(model: nn.Module, seed: int = 123) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout masks
    model(input_ids=IDS, labels=IDS).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def peak_of(model: nn.Module) -> int:
    meter = ActivationMeter(param_tensors(model))
    with meter:
        model(input_ids=IDS, labels=IDS).loss.backward()
    model.zero_grad(set_to_none=True)
    return meter.peak


def test_meter_counts_saved_storages_once() -> None:
    """Independent count: Linear-ReLU-Linear saves the input and the ReLU output (shared by the second
    Linear), nothing else; weights are not counted."""
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x = torch.randn(50, 64)
    meter = ActivationMeter(param_tensors(net))
    with meter:
        net(x).sum().backward()
    assert meter.peak == 50 * 64 * 4 + 50 * 256 * 4


@pytest.mark.parametrize("make", [tiny_llama, tiny_opt])
@pytest.mark.parametrize("strategy", ["checkpoint", "sac", RECOMPUTE, SELECTIVE])
def test_recompute_gives_identical_gradients(make, strategy: str) -> None:  # noqa: ANN001
    model = make()
    model.config.use_cache = False
    ref = grads(model)
    blocks = find_blocks(model)
    if strategy in (RECOMPUTE, SELECTIVE):
        options = {GroupKey(i, n): strategy for i, b in enumerate(blocks) for n, _ in b.named_children()
                   if any(True for _ in _.parameters())}
        applied = AppliedPlan(model, blocks, [False] * len(blocks), options)
    else:
        applied = apply_strategy(model, blocks, strategy)
    got = grads(model)
    applied.remove()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(grads(model), ref)  # removing the plan restores the model


@pytest.mark.parametrize("make", [tiny_llama, tiny_opt])
@pytest.mark.parametrize("comp", ["int8-channel", "int8-token", "bf16"])
def test_compression_keeps_gradients_close(make, comp: str) -> None:  # noqa: ANN001
    model = make()
    model.config.use_cache = False
    ref = grads(model)
    blocks = find_blocks(model)
    options = {GroupKey(i, n): comp for i, b in enumerate(blocks) for n in [*dict(b.named_children()), "_self"]}
    applied = AppliedPlan(model, blocks, [False] * len(blocks), options)
    got = grads(model)
    peak = peak_of(model)
    applied.remove()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=0).item()
    assert cos > 0.99
    assert not torch.equal(got, ref)  # compression really happened
    assert peak < peak_of(model)


@pytest.mark.parametrize("make", [tiny_llama, tiny_opt])
def test_adacc_measured_peak_within_budget(make) -> None:  # noqa: ANN001
    model = make()
    losses = []
    for frac in (0.45, 0.7):
        adacc = Adacc(model, budget=frac)
        plan = adacc.prepare(input_ids=IDS, labels=IDS)
        assert plan.measured_peak <= plan.budget_bytes
        assert peak_of(model) <= plan.budget_bytes
        losses.append(model(input_ids=IDS, labels=IDS).loss.item())
        adacc.remove()
    assert abs(losses[0] - losses[1]) < 0.05 * losses[0]


def test_adacc_plain_stack_and_training_loop() -> None:
    model = Stack()
    x = torch.randn(4, 48, 64)
    adacc = Adacc(model, budget=0.5, loss_fn=lambda y: y.square().mean())
    plan = adacc.prepare(x)
    assert plan.measured_peak <= plan.budget_bytes
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = None
    for _ in range(5):
        loss = model(x).square().mean()
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
        adacc.step()
    assert loss.item() < first


def test_budget_below_minimum_names_it() -> None:
    model = tiny_llama()
    with pytest.raises(LeanmlError, match=r"below the smallest feasible plan .* MiB"):
        Adacc(model, budget=0.02).prepare(input_ids=IDS, labels=IDS)


def test_bad_inputs() -> None:
    with pytest.raises(LeanmlError, match="repeated blocks"):
        Adacc(nn.Linear(3, 3))
    with pytest.raises(LeanmlError, match="cannot read memory budget"):
        Budget.parse("lots")
    with pytest.raises(LeanmlError, match="positive"):
        Budget.parse(-1)
    assert Budget.parse("2GB") == Budget("bytes", 2e9)
    assert Budget.parse("512MiB") == Budget("bytes", 512 * 2**20)
    assert Budget.parse(0.25) == Budget("fraction", 0.25)
    assert Budget.parse(3_000_000) == Budget("bytes", 3e6)


def test_drift_monitor_thresholds() -> None:
    mon = DriftMonitor(DriftThresholds(window=3))
    mon.reset({"L0.mlp": 0.01}, {"L0.mlp": 0.05}, {"L0.mlp": 10.0})
    assert mon.check({"L0.mlp": 0.012}, {"L0.mlp": 12.0}) == []
    assert "drifted" in mon.check({"L0.mlp": 0.03}, {})[0]
    assert "above cap" in mon.check({"L0.mlp": 0.06}, {})[0]
    assert "outlier" in mon.check({}, {"L0.mlp": 30.0})[0]
    for t in [1.0] * 4 + [2.0] * 3:
        mon.add_step_time(t)
    assert "step time" in mon.check({}, {})[0]


def test_outlier_drift_triggers_replan(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_llama()
    adacc = Adacc(model, budget=0.6, compressors=("int8-token",), max_error=0.5, check_every=2,
                  outlier_frac=0.0)
    plan = adacc.prepare(input_ids=IDS, labels=IDS)
    assert "int8-token" in plan.summary()
    with torch.no_grad():  # a sudden outlier channel in every norm output
        for layer in model.model.layers:
            layer.input_layernorm.weight[3] = 300.0
            layer.post_attention_layernorm.weight[3] = 300.0
    caplog.set_level(logging.INFO)
    replanned = []
    for _ in range(4):
        model(input_ids=IDS, labels=IDS).loss.backward()
        model.zero_grad()
        replanned += adacc.step()
    assert replanned and len(adacc.history) == 2
    assert "re-planning" in caplog.text


def test_dropout_masks_are_bitpacked_losslessly() -> None:
    """OPT in training mode saves dropout keep-masks (0 or 1/(1-p) floats on CPU); the profile finds them,
    bit packing stores them 32x smaller, and gradients stay bit-identical."""
    from leanml.memory.profiler import ProfileOptions, profile_step
    from leanml.memory.runtime import BITPACK

    model = tiny_opt()
    model.config.use_cache = False
    prof = profile_step(model, find_blocks(model), lambda: model(input_ids=IDS, labels=IDS).loss,
                        ProfileOptions(compressors=("bf16",)))
    model.zero_grad(set_to_none=True)
    masked = {k: g for k, g in prof.groups.items() if g.mask_bytes and k.layer is not None}
    assert masked
    for g in masked.values():
        st = g.compress[BITPACK]
        assert st.error == 0.0 and st.payload_bytes < g.bytes - g.mask_bytes + g.mask_bytes // 16
    ref = grads(model)
    blocks = find_blocks(model)
    applied = AppliedPlan(model, blocks, [False] * len(blocks), {k: BITPACK for k in masked},
                          Compression(mask_groups=set(masked)))
    got = grads(model)
    packed_peak = peak_of(model)
    applied.remove()
    assert torch.equal(got, ref)
    assert packed_peak < peak_of(model)
