"""Physical shrinking after structured pruning of interlinked pairs.

Structured methods (:mod:`leanml.prune.methods.fasp`) prune a unit by setting its producer rows (and
biases) and its consumer columns to exact zeros. This module turns that into smaller modules:

- :func:`shrink_mlp` rebuilds every MLP pair with only the live units as new ``nn.Linear`` modules
  and writes the new width into the config key ``adapter.intermediate_size_key``, so the saved model
  loads with plain ``AutoModelForCausalLM.from_pretrained`` and has fewer parameters. All layers share
  one width (the config has one): a layer with fewer live units keeps some zero units as padding,
  which is exact.
- :func:`ensure_bias_format` makes biases added by bias compensation loadable by the stock classes
  (e.g. LLaMA's ``mlp_bias`` / ``attention_bias`` flags, with zero biases on the other linears).

Attention pairs keep their shapes (stock attention modules need one head dimension): pruned value
rows and output-projection columns stay exact zeros. :func:`live_units` finds them again from the
weights, so this works on any model saved by a structured method, also one pruned by several ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from leanml.prune.base import Group


def live_units(group: Group) -> torch.Tensor:
    """Indices of the units of a structured pair that are not pruned.

    A unit is pruned when all its consumer columns and all its producer rows (weights and biases) are
    exactly zero. Requires ``group.units`` and exactly one consumer linear.
    """
    assert group.units is not None and len(group.linears) == 1
    consumer = next(iter(group.linears.values()))
    cols, rows = group.units.columns, group.units.rows
    dead = (consumer.weight.detach()[:, cols.flatten()] == 0).all(dim=0).reshape(cols.shape).all(dim=1)
    for prod in group.producers.values():
        w = prod.weight.detach()[rows.flatten()]
        dead &= (w == 0).all(dim=1).reshape(rows.shape).all(dim=1)
        if prod.bias is not None:
            dead &= (prod.bias.detach()[rows.flatten()] == 0).reshape(rows.shape).all(dim=1)
    return (~dead).nonzero().flatten()


def select_rows(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A new ``nn.Linear`` with only the output ``rows`` of ``linear``."""
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
    """Number of distinct parameters (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def count_nonzero(model: nn.Module) -> int:
    """Number of non-zero values among the distinct parameters."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += int((p.detach() != 0).sum())
    return total


def _pair_group(adapter: Any, layer: nn.Module, name: str) -> Group | None:
    for group in adapter.groups(layer):
        if group.name == name and group.units is not None:
            return group
    return None


def shrink_mlp(model: nn.Module, adapter: Any) -> dict[str, Any]:
    """Physically remove pruned MLP units of every layer; update the config's MLP width.

    Returns ``{"intermediate_size": new width, "live_units": [per layer]}``. A model without pruned
    MLP units is left unchanged.
    """
    layers = adapter.layers()
    plans = []
    for layer in layers:
        group = _pair_group(adapter, layer, "mlp_out")
        if group is None:
            return {"intermediate_size": None, "live_units": []}
        plans.append((group, live_units(group)))
    width = max(int(live.numel()) for _, live in plans)
    old = int(plans[0][0].units.columns.shape[0]) if plans else 0
    if not plans or width == old:
        return {"intermediate_size": old, "live_units": [int(lv.numel()) for _, lv in plans]}
    for layer, (group, live) in zip(layers, plans):
        n = int(group.units.columns.shape[0])
        if live.numel() < width:  # pad with dead units so every layer has the config's width
            dead = torch.ones(n, dtype=torch.bool)
            dead[live] = False
            pad = dead.nonzero().flatten()[: width - live.numel()]
            live = torch.cat([live, pad]).sort().values
        rows = group.units.rows[live].flatten()
        cols = group.units.columns[live].flatten()
        for name, prod in group.producers.items():
            replace_module(layer, name, select_rows(prod, rows))
        for name, cons in group.linears.items():
            replace_module(layer, name, select_columns(cons, cols))
    setattr(model.config, adapter.intermediate_size_key, width)
    return {"intermediate_size": width, "live_units": [int(lv.numel()) for _, lv in plans]}


#: config flag -> (pair group whose consumer may gain a bias, groups whose linears the flag covers)
_BIAS_FLAGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mlp_bias": ("mlp_out", ("mlp_in", "mlp_out")),
    "attention_bias": ("attn_out", ("attn_in", "attn_out")),
}


def ensure_bias_format(model: nn.Module, adapter: Any) -> list[str]:
    """Make biases added to consumers (bias compensation) part of the stock format.

    For configs with a bias flag (LLaMA's ``mlp_bias`` / ``attention_bias``) that is off while some
    consumer now has a bias: turn the flag on and give every linear the flag covers a bias (zeros where
    there was none, which is exact). Returns the flags turned on.
    """
    turned_on = []
    for flag, (pair, covered) in _BIAS_FLAGS.items():
        if getattr(model.config, flag, None) is not False:
            continue
        layers = adapter.layers()
        if not any((g := _pair_group(adapter, layer, pair)) and next(iter(g.linears.values())).bias is not None
                   for layer in layers):
            continue
        for layer in layers:
            for group in adapter.groups(layer):
                if group.name not in covered:
                    continue
                for lin in group.linears.values():
                    if lin.bias is None:
                        w = lin.weight
                        lin.bias = nn.Parameter(torch.zeros(lin.out_features, dtype=w.dtype, device=w.device))
        setattr(model.config, flag, True)
        turned_on.append(flag)
    return turned_on
