"""Per-architecture adapters: where the decoder layers are, which linears form which group, which
structured pairs may be cut, and how to rebuild the config.

One adapter per architecture family; algorithms only talk to :class:`DecoderAdapter`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from leanml.prune.base import Group, StructUnits
from leanml.utils import LeanmlError


class DecoderAdapter(ABC):
    """What the engine needs to know about one decoder-only architecture."""

    #: ``config.model_type`` values this adapter handles
    model_types: tuple[str, ...] = ()
    #: config key holding the MLP width (rewritten when structured pruning shrinks the MLP)
    intermediate_size_key: str = "intermediate_size"

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config

    @abstractmethod
    def layers(self) -> nn.ModuleList:
        """The decoder layers, in order."""

    @abstractmethod
    def groups(self, layer: nn.Module) -> list[Group]:
        """The layer's linears grouped by shared input, in forward order."""

    @property
    def num_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None) or self.config.hidden_size // self.num_heads)

    @property
    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings)

    def attention_units(self) -> StructUnits:
        """Units of the value -> output-projection pair.

        A unit is one value dimension ``d`` of one key/value head ``g``: value row ``g*hd + d``; it
        feeds output-projection column ``h*hd + d`` of every query head ``h`` in the group of ``g``.
        """
        hd, nq, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        rep = nq // nkv
        rows, cols = [], []
        for g in range(nkv):
            for d in range(hd):
                rows.append([g * hd + d])
                cols.append([(g * rep + r) * hd + d for r in range(rep)])
        return StructUnits(columns=torch.tensor(cols), rows=torch.tensor(rows), kind="attention")

    @staticmethod
    def mlp_units(width: int) -> StructUnits:
        """Units of the MLP pair: unit ``j`` is row ``j`` of the input linears and column ``j`` of the output."""
        idx = torch.arange(width).unsqueeze(1)
        return StructUnits(columns=idx, rows=idx.clone(), kind="mlp")

    def describe(self) -> dict[str, Any]:
        return {
            "adapter": type(self).__name__,
            "model_type": self.config.model_type,
            "layers": len(self.layers()),
            "hidden_size": self.config.hidden_size,
            "heads": self.num_heads,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }


def _named(layer: nn.Module, names: list[str]) -> dict[str, nn.Linear]:
    return {name: layer.get_submodule(name) for name in names}


class LlamaAdapter(DecoderAdapter):
    """LLaMA family (LLaMA 2/3, SmolLM2, Mistral, Qwen2 layouts) incl. grouped-query attention."""

    model_types = ("llama", "mistral", "qwen2", "smollm3")

    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def groups(self, layer: nn.Module) -> list[Group]:
        mlp_width = layer.mlp.down_proj.in_features
        return [
            Group("attn_in", _named(layer, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])),
            Group(
                "attn_out",
                _named(layer, ["self_attn.o_proj"]),
                producers=_named(layer, ["self_attn.v_proj"]),
                units=self.attention_units(),
            ),
            Group("mlp_in", _named(layer, ["mlp.gate_proj", "mlp.up_proj"])),
            Group(
                "mlp_out",
                _named(layer, ["mlp.down_proj"]),
                producers=_named(layer, ["mlp.gate_proj", "mlp.up_proj"]),
                units=self.mlp_units(mlp_width),
            ),
        ]


class OPTAdapter(DecoderAdapter):
    """OPT (facebook/opt-*)."""

    model_types = ("opt",)
    intermediate_size_key = "ffn_dim"

    def layers(self) -> nn.ModuleList:
        return self.model.model.decoder.layers

    @property
    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings)

    def groups(self, layer: nn.Module) -> list[Group]:
        return [
            Group("attn_in", _named(layer, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])),
            Group(
                "attn_out",
                _named(layer, ["self_attn.out_proj"]),
                producers=_named(layer, ["self_attn.v_proj"]),
                units=self.attention_units(),
            ),
            Group("mlp_in", _named(layer, ["fc1"])),
            Group(
                "mlp_out",
                _named(layer, ["fc2"]),
                producers=_named(layer, ["fc1"]),
                units=self.mlp_units(layer.fc2.in_features),
            ),
        ]


ADAPTERS: list[type[DecoderAdapter]] = [LlamaAdapter, OPTAdapter]


def supported_model_types() -> list[str]:
    return sorted(t for a in ADAPTERS for t in a.model_types)


def get_adapter(model: nn.Module) -> DecoderAdapter:
    """The adapter for ``model``; :class:`LeanmlError` naming the supported types otherwise."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls(model)
    raise LeanmlError(
        f"unsupported architecture {model_type!r}; supported: {', '.join(supported_model_types())}"
    )
