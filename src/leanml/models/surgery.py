"""Changing a model's modules and config so that it stays loadable by the stock classes.

Structured methods prune a unit by setting its producer rows (and biases) and its consumer columns to
exact zeros. This module turns that into smaller modules and a matching config:

- :func:`shrink_mlp` rebuilds every MLP pair with only the live units as new ``nn.Linear`` modules
  (fused producers keep their parts contiguous) and writes the new width into the config key
  ``adapter.intermediate_size_key``, so the saved model loads with plain
  ``AutoModelForCausalLM.from_pretrained`` and has fewer parameters. All layers share one width (the
  config has one): a layer with fewer live units keeps some zero units as padding, which is exact.
- :func:`ensure_bias_format` makes biases added by bias compensation loadable (turns on the family's
  bias flag and gives every linear the flag covers a zero bias).
- :func:`load_layer_state` loads a saved decoder-layer state that may hold biases the fresh layer lacks.

Attention pairs keep their shapes (stock attention modules need one head dimension): pruned value
rows and output-projection columns stay exact zeros. :func:`live_units` finds them again from the
weights, so this works on any model saved by a structured method, also one pruned by several ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from leanml.models.layout import DecoderAdapter, Group


def live_units(group: Group) -> torch.Tensor:
    """Indices of the units of a structured pair that are not pruned.

    A unit is pruned when all its consumer columns and all its producer rows (weights and biases) are
    exactly zero. Requires ``group.units`` and exactly one consumer linear.
    """
    assert group.units is not None and len(group.linears) == 1
    consumer = next(iter(group.linears.values()))
    cols = group.units.columns
    dead = (consumer.weight.detach()[:, cols.flatten()] == 0).all(dim=0).reshape(cols.shape).all(dim=1)
    for name, prod in group.producers.items():
        rows = group.units.rows[name]
        w = prod.weight.detach()[rows.flatten()]
        dead &= (w == 0).all(dim=1).reshape(rows.shape).all(dim=1)
        if prod.bias is not None:
            dead &= (prod.bias.detach()[rows.flatten()] == 0).reshape(rows.shape).all(dim=1)
    return (~dead).nonzero().flatten()


def select_rows(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A new ``nn.Linear`` with only the output ``rows`` of ``linear`` (in that order)."""
    w = linear.weight.detach()
    new = nn.Linear(linear.in_features, rows.numel(), bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w[rows])
        if linear.bias is not None:
            new.bias.copy_(linear.bias.detach()[rows])
    return new


def select_columns(linear: nn.Linear, cols: torch.Tensor) -> nn.Linear:
    """A new ``nn.Linear`` with only the input columns ``cols`` of ``linear`` (bias unchanged)."""
    w = linear.weight.detach()
    new = nn.Linear(cols.numel(), linear.out_features, bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w[:, cols])
        if linear.bias is not None:
            new.bias.copy_(linear.bias.detach())
    return new


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at qualified ``name`` inside ``root``."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (``parameters()`` yields a tied weight once)."""
    return sum(p.numel() for p in model.parameters())


def count_nonzero(model: nn.Module) -> int:
    """Number of non-zero values among the distinct parameters."""
    return sum(int((p.detach() != 0).sum()) for p in model.parameters())


def _mlp_pair(adapter: DecoderAdapter, layer: nn.Module) -> Group | None:
    if adapter.mlp_out is None:
        return None
    return next(g for g in adapter.pairs(layer) if g.name == "mlp_out")


def cut_mlp(layer: nn.Module, group: Group, live: torch.Tensor) -> None:
    """Keep only the MLP units ``live`` (sorted) of one layer's MLP pair: new producer and consumer
    modules; fused producers keep their parts contiguous (all gate rows, then all up rows)."""
    assert group.units is not None
    cols = group.units.columns[live].flatten()
    for name, prod in group.producers.items():
        rows = group.units.rows[name][live].T.flatten()  # segment-major: parts stay contiguous
        replace_module(layer, name, select_rows(prod, rows))
    for name, cons in group.linears.items():
        replace_module(layer, name, select_columns(cons, cols))


def shrink_mlp(model: nn.Module, adapter: DecoderAdapter) -> dict[str, Any]:
    """Physically remove pruned MLP units of every layer; update the config's MLP width.

    Returns ``{"intermediate_size": new width, "live_units": [per layer]}``. A model without pruned
    MLP units is left unchanged.
    """
    layers = adapter.layers()
    plans = []
    for layer in layers:
        group = _mlp_pair(adapter, layer)
        if group is None:
            return {"intermediate_size": None, "live_units": []}
        plans.append((group, live_units(group)))
    width = max(int(live.numel()) for _, live in plans)
    old = plans[0][0].units.n_units if plans else 0
    if not plans or width == old:
        return {"intermediate_size": old, "live_units": [int(lv.numel()) for _, lv in plans]}
    for layer, (group, live) in zip(layers, plans):
        if live.numel() < width:  # pad with dead units so every layer has the config's width
            dead = torch.ones(group.units.n_units, dtype=torch.bool)
            dead[live] = False
            pad = dead.nonzero().flatten()[: width - live.numel()]
            live = torch.cat([live, pad]).sort().values
        cut_mlp(layer, group, live)
    setattr(model.config, adapter.intermediate_size_key, width)
    return {"intermediate_size": width, "live_units": [int(lv.numel()) for _, lv in plans]}


def ensure_bias_format(model: nn.Module, adapter: DecoderAdapter) -> list[str]:
    """Make biases added to linears (bias compensation) part of the stock format.

    For every bias flag of the family that is off while a linear it covers now has a bias: turn the
    flag on and give every linear the flag covers a bias (zeros where there was none, which is exact).
    Returns the flags turned on.
    """
    turned_on = []
    layers = adapter.layers()
    for flag, names in adapter.bias_flags.items():
        if getattr(model.config, flag, None) is not False:
            continue
        if not any(layer.get_submodule(n).bias is not None for layer in layers for n in names):
            continue
        for layer in layers:
            for n in names:
                lin = layer.get_submodule(n)
                if lin.bias is None:
                    w = lin.weight
                    lin.bias = nn.Parameter(torch.zeros(lin.out_features, dtype=w.dtype, device=w.device))
        setattr(model.config, flag, True)
        turned_on.append(flag)
    return turned_on


def load_layer_state(layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a decoder layer's saved state; a linear whose saved state has a bias it lacks (added by bias
    compensation) gets a bias parameter first."""
    own = layer.state_dict()
    for key, value in state.items():
        if key not in own and key.endswith(".bias"):
            module = layer.get_submodule(key[: -len(".bias")])
            if isinstance(module, nn.Linear) and module.bias is None:
                module.bias = nn.Parameter(torch.zeros_like(value, device=module.weight.device))
    layer.load_state_dict(state)
