"""Changing a model's modules and config so that it stays loadable by the stock classes.

Structured methods prune a unit by setting its producer rows (and biases) and its consumer columns to
exact zeros. This module turns that into smaller modules and a matching config:

- :func:`shrink_mlp` rebuilds every MLP pair with only the live units as new ``nn.Linear`` modules
  (fused producers keep their parts contiguous) and writes the new width into the config key
  ``adapter.intermediate_size_key``, so the saved model loads with plain
  ``AutoModelForCausalLM.from_pretrained`` and has fewer parameters. All layers share one width (the
  config has one): a layer with fewer live units keeps some zero units as padding, which is exact.
- :func:`shrink_attention` removes whole key/value groups (a key/value head with its query heads: their
  query, key and value rows and output-projection columns) and rewrites ``num_attention_heads`` and
  ``num_key_value_heads``, writing ``head_dim`` explicitly so the head size stays what it was. All
  layers share the config's head counts, so (as for the MLP) every layer keeps the largest live count among
  the layers, dead groups padding the others (exact, they are zeros).
- :func:`ensure_bias_format` makes biases added by bias compensation loadable (turns on the family's
  bias flag and gives every linear the flag covers a zero bias).
- :func:`load_layer_state` loads a saved decoder-layer state that may hold biases the fresh layer lacks.

:func:`live_units` finds the pruned units again from the weights (all their rows and columns exact
zeros), so this works on any model saved by a structured method, also one pruned by several ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from leanml.config import ConfigError
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


def _pair(adapter: DecoderAdapter, layer: nn.Module, name: str) -> Group | None:
    return next((g for g in adapter.pairs(layer) if g.name == name), None)


def cut_units(layer: nn.Module, group: Group, live: torch.Tensor) -> None:
    """Keep only the units ``live`` (sorted) of one layer's structured pair: new producer and consumer
    modules. Kept producer rows stay in their original order, so fused producers keep their parts
    contiguous (Phi-3's gate_up_proj: all gate rows, then all up rows; its qkv_proj: queries, keys,
    values)."""
    assert group.units is not None
    cols = group.units.columns[live].flatten().sort().values
    for name, prod in group.producers.items():
        rows = group.units.rows[name][live].flatten().sort().values
        replace_module(layer, name, select_rows(prod, rows))
    for name, cons in group.linears.items():
        replace_module(layer, name, select_columns(cons, cols))


#: the MLP cut of one layer (kept under its former name)
cut_mlp = cut_units


def _shrink_pair(adapter: DecoderAdapter, name: str) -> tuple[int | None, int | None, list[int]]:
    """Remove the dead units of pair ``name`` in every layer, all layers keeping the largest live count
    (padded with dead units, which is exact). Returns (units before, units after, live per layer);
    ``(None, None, [])`` without such a pair; the modules are unchanged when no unit is dead."""
    layers = adapter.layers()
    plans = []
    for layer in layers:
        group = _pair(adapter, layer, name)
        if group is None or group.units is None:
            return None, None, []
        plans.append((group, live_units(group)))
    old = plans[0][0].units.n_units
    live_counts = [int(lv.numel()) for _, lv in plans]
    width = max(live_counts)
    if width == old:
        return old, old, live_counts
    for layer, (group, live) in zip(layers, plans):
        if live.numel() < width:  # pad with dead units so every layer has the config's width
            dead = torch.ones(group.units.n_units, dtype=torch.bool)
            dead[live] = False
            pad = dead.nonzero().flatten()[: width - live.numel()]
            live = torch.cat([live, pad]).sort().values
        cut_units(layer, group, live)
    return old, width, live_counts


def shrink_mlp(model: nn.Module, adapter: DecoderAdapter) -> dict[str, Any]:
    """Physically remove pruned MLP units of every layer; update the config's MLP width.

    Returns ``{"intermediate_size": new width, "live_units": [per layer]}``. A model without pruned
    MLP units is left unchanged.
    """
    if adapter.mlp_out is None:
        return {"intermediate_size": None, "live_units": []}
    old, width, live = _shrink_pair(adapter, "mlp_out")
    if width is not None and width != old:
        setattr(model.config, adapter.intermediate_size_key, width)
    return {"intermediate_size": width, "live_units": live}


def shrink_attention(model: nn.Module, adapter: DecoderAdapter) -> dict[str, Any]:
    """Physically remove pruned key/value groups of every layer; rewrite the config's head counts.

    A group is pruned when its query, key and value rows (and biases) and its output-projection columns
    are all exact zeros. Every layer keeps the largest live group count among the layers. The config
    gets ``num_key_value_heads = live``, ``num_attention_heads = live * query heads per group`` and an
    explicit ``head_dim`` (unchanged), so plain ``from_pretrained`` builds the smaller attention.
    Returns ``{"num_key_value_heads": ..., "num_attention_heads": ..., "live_groups": [per layer]}``
    (``None`` counts without an attention pair). Raises :class:`LeanmlError` when groups are dead in a
    family whose stock attention cannot lose heads.
    """
    if adapter.o_proj is None or adapter.v_proj is None:
        return {"num_key_value_heads": None, "num_attention_heads": None, "live_groups": []}
    rep, head_dim = adapter.group_size, adapter.head_dim
    layers = adapter.layers()
    first = _pair(adapter, layers[0], "attn_out")
    reason = first.fixed_reason if first is not None else None
    if reason is not None and any(
        live_units(g).numel() < g.units.n_units  # type: ignore[union-attr]
        for g in (_pair(adapter, layer, "attn_out") for layer in layers) if g is not None
    ):
        raise ConfigError(f"{reason}; prune with pairs mlp", None, ("pairs",))
    old, groups, live = _shrink_pair(adapter, "attn_out")
    if groups is not None and groups != old:
        model.config.head_dim = head_dim
        model.config.num_key_value_heads = groups
        model.config.num_attention_heads = groups * rep
        counts = {"num_key_value_heads": groups, "num_heads": groups * rep, "num_attention_heads": groups * rep}
        parent = adapter.o_proj.rpartition(".")[0]
        for layer in layers:  # head counts some attention modules keep from their construction (Phi-3)
            attn = layer.get_submodule(parent) if parent else layer
            for attr, value in counts.items():
                if isinstance(getattr(attn, attr, None), int):
                    setattr(attn, attr, value)
    return {"num_key_value_heads": groups, "num_attention_heads": None if groups is None else groups * rep,
            "live_groups": live}


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
