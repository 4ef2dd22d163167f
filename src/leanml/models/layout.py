"""What pruning and memory planning need to know about a decoder-only model, found or declared.

Two kinds of knowledge live here:

- **Found automatically** (any decoder-only ``AutoModelForCausalLM`` whose layers are an
  ``nn.ModuleList``): the decoder layers (:func:`find_layers`) and, per layer, the linears grouped by
  the input tensor they read, in forward order (:func:`discover_groups`). Unstructured and N:M
  pruning need nothing more.
- **Declared per family** (:class:`DecoderAdapter` subclasses in :mod:`leanml.models.adapters`): the
  structured pairs (attention heads -> output projection, MLP input -> MLP output), including fused
  projections, which rows of a fused weight belong to which unit, whether the stock attention can lose
  heads, the config key of the MLP width and the config flags that let stock classes load added
  biases.

Nothing here imports from :mod:`leanml.prune`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from leanml.errors import LeanmlError

#: attribute paths of the decoder-layer list in common causal LMs, tried before a generic search
LAYER_PATHS = (
    "model.layers",  # LLaMA, Mistral, Qwen2/3, Gemma2/3, Phi3, SmolLM2
    "model.decoder.layers",  # OPT
    "gpt_neox.layers",  # GPT-NeoX, Pythia
    "transformer.h",  # GPT-2, Falcon, BLOOM
    "transformer.blocks",
    "model.transformer.h",
    "layers",
    "blocks",
    "h",
)

#: config attributes that mark a mixture-of-experts model when above 1
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class StructUnits:
    """Removable structured units of a (producers -> consumer) pair.

    ``columns``: (n_units, cols_per_unit) long tensor of consumer input columns per unit.
    ``rows``: per producer name, a (n_units, segments) long tensor of that producer's output rows per
    unit. A plain producer has one segment; a fused producer has one per part it fuses (Phi-3's
    ``gate_up_proj``: unit ``j`` is rows ``j`` and ``I + j``), and shrinking keeps the parts contiguous.
    ``kind``: ``"mlp"`` or ``"attention"``. An attention unit is one key/value group: a key/value head
    with the query heads that read it; its rows are the group's query, key and value rows (per producer,
    ascending) and its columns the output-projection columns its query heads feed.
    """

    columns: torch.Tensor
    rows: dict[str, torch.Tensor]
    kind: str

    @property
    def n_units(self) -> int:
        return int(self.columns.shape[0])


@dataclass
class Group:
    """Linears of one decoder layer that read the same input.

    ``linears`` maps each linear's qualified name inside the decoder layer (e.g. ``"mlp.down_proj"``) to
    the module, in forward order. For a structured pair, ``producers`` maps the earlier linears whose
    output rows feed this group's input columns elementwise and ``units`` describes the removable units.
    """

    name: str
    linears: dict[str, nn.Linear]
    producers: dict[str, nn.Linear] = field(default_factory=dict)
    units: StructUnits | None = None
    #: for a pair: whether its consumer may carry a bias in a model the stock class loads
    consumer_bias_ok: bool = True
    #: for a pair whose units the stock classes cannot drop physically: why (a one-line reason)
    fixed_reason: str | None = None

    @property
    def leader(self) -> str:
        """The first linear: its input is the group's input."""
        return next(iter(self.linears))


# --------------------------------------------------------------------------------------------------
# layers and linears, found automatically


def _get_path(model: nn.Module, path: str) -> Any:
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_layers(model: nn.Module) -> nn.ModuleList | None:
    """The repeated blocks of ``model``: a known path, else the longest ``nn.ModuleList`` of modules of
    one class that hold parameters; ``None`` when there is none."""
    for path in LAYER_PATHS:
        mod = _get_path(model, path)
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            return mod
    best: nn.ModuleList | None = None
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > (len(best) if best is not None else 0):
            classes = Counter(type(m) for m in mod)
            if len(classes) == 1 and any(True for _ in mod[0].parameters()):
                best = mod
    return best


def layer_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` inside a decoder layer, by qualified name, in registration order."""
    return {name: mod for name, mod in layer.named_modules() if isinstance(mod, nn.Linear)}


def check_dense_layer(model_type: str, layer: nn.Module) -> None:
    """Refuse layers whose weights are not all in ``nn.Linear`` s that every token uses (mixture of
    experts keeps experts as 3-D tensors or calls each expert on some tokens only)."""
    linear_weights = {id(m.weight) for m in layer.modules() if isinstance(m, nn.Linear)}
    odd = [name for name, p in layer.named_parameters() if p.dim() >= 2 and id(p) not in linear_weights]
    if odd:
        raise LeanmlError(
            f"{model_type}: decoder layers hold weights outside nn.Linear ({', '.join(odd[:3])}"
            f"{', ...' if len(odd) > 3 else ''}); leanml prunes nn.Linear weights only and would leave "
            "these dense: convert them to nn.Linear first"
        )


def group_name(names: list[str]) -> str:
    """A discovered group's name: its linears' names joined by ``+``."""
    return "+".join(names)


def group_calls(
    linears: dict[str, nn.Linear], calls: list[tuple[str, torch.Tensor]], model_type: str = "model"
) -> list[tuple[str, list[str]]]:
    """Group the linears of a layer by the input tensor each received in one forward pass, in forward
    order: ``[(group name, [linear names])]``.

    ``calls`` lists ``(linear name, input)`` in call order; the inputs must have been kept alive during
    the pass so their identity is a reliable key. Every linear must be called exactly once: raises
    :class:`LeanmlError` naming what was found when a linear is never called (conditional computation
    such as mixture-of-experts routing) or called several times.
    """
    if not linears:
        raise LeanmlError(f"{model_type}: found no nn.Linear in a decoder layer; leanml prunes nn.Linear layers only")
    counts = Counter(name for name, _ in calls)
    missing = [n for n in linears if counts[n] == 0]
    if missing:
        raise LeanmlError(
            f"{model_type}: linears {', '.join(missing[:4])} were not called on the calibration batch "
            "(conditional computation, e.g. mixture-of-experts routing); leanml cannot prune this layer"
        )
    repeated = [n for n, c in counts.items() if c > 1]
    if repeated:
        raise LeanmlError(
            f"{model_type}: linears {', '.join(repeated[:4])} run more than once per layer forward; "
            "leanml cannot gather their statistics"
        )
    order: list[tuple[Any, list[str]]] = []
    for name, x in calls:
        key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype)
        for k, names in order:
            if k == key:
                names.append(name)
                break
        else:
            order.append((key, [name]))
    return [(group_name(names), names) for _, names in order]


@torch.no_grad()
def discover_groups(layer: nn.Module, run: Callable[[], Any], model_type: str = "model") -> list[Group]:
    """Run ``layer``'s forward once through ``run()`` (e.g. on one calibration batch) and return its
    linears grouped by the input tensor they receive, in forward order (see :func:`group_calls`)."""
    linears = layer_linears(layer)
    calls: list[tuple[str, torch.Tensor]] = []
    handles = []
    for name, mod in linears.items():
        def hook(module: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            calls.append((name, args[0]))

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return [Group(name, {n: linears[n] for n in names}) for name, names in group_calls(linears, calls, model_type)]


# --------------------------------------------------------------------------------------------------
# the adapter: automatic parts for every model, declared parts per family


class DecoderAdapter:
    """What the engine, the evaluator and the memory planner need about one decoder-only model.

    The base class works for any decoder-only causal LM whose layers are an ``nn.ModuleList``
    (unstructured and N:M pruning). A family subclass declares its structured pairs by class
    attributes (names inside a decoder layer); fused projections override :meth:`group_rows`.
    """

    #: ``config.model_type`` values this adapter handles (empty for the generic adapter)
    model_types: ClassVar[tuple[str, ...]] = ()
    #: attention query, key and value projections (one fused qkv projection: ``v_proj`` alone, with
    #: :meth:`group_rows` overridden) and output projection
    q_proj: ClassVar[str | None] = None
    k_proj: ClassVar[str | None] = None
    v_proj: ClassVar[str | None] = None
    o_proj: ClassVar[str | None] = None
    #: why the family's stock attention cannot lose heads (``None``: it reads ``head_dim`` from the
    #: config, so ``num_attention_heads`` / ``num_key_value_heads`` may shrink)
    fixed_heads: ClassVar[str | None] = None
    #: MLP producers (their output rows are the MLP units) and consumer
    mlp_in: ClassVar[tuple[str, ...]] = ()
    mlp_out: ClassVar[str | None] = None
    #: parts fused along the output rows of each MLP producer (Phi-3's gate_up_proj: 2)
    mlp_segments: ClassVar[int] = 1
    #: config key holding the MLP width (rewritten when structured pruning shrinks the MLP)
    intermediate_size_key: ClassVar[str] = "intermediate_size"
    #: config flag -> the linears it gives a bias when on (lets stock classes load added biases)
    bias_flags: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.model_type = str(getattr(self.config, "model_type", type(model).__name__))
        if getattr(self.config, "is_encoder_decoder", False):
            raise LeanmlError(f"{self.model_type} is an encoder-decoder model; leanml prunes decoder-only causal LMs")
        moe = {k: getattr(self.config, k) for k in MOE_KEYS if (getattr(self.config, k, None) or 0) > 1}
        if moe:
            key, n = next(iter(moe.items()))
            raise LeanmlError(
                f"{self.model_type} is a mixture-of-experts model ({key}={n}); leanml does not prune "
                "experts: use a dense model"
            )
        layers = find_layers(model)
        if layers is None:
            raise LeanmlError(
                f"found no decoder layers in {type(model).__name__} ({self.model_type}): leanml needs the "
                "layers as an nn.ModuleList of identical blocks"
            )
        self._layers = layers
        check_dense_layer(self.model_type, layers[0])

    # ---- found automatically ---------------------------------------------------------------------
    def layers(self) -> nn.ModuleList:
        """The decoder layers, in order."""
        return self._layers

    def linears(self, layer: nn.Module) -> dict[str, nn.Linear]:
        """Every linear of a decoder layer (what unstructured methods prune)."""
        return layer_linears(layer)

    # ---- config facts ----------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None) or self.config.hidden_size // self.num_heads)

    # ---- declared per family: structured pairs ---------------------------------------------------
    @property
    def has_pairs(self) -> bool:
        return self.o_proj is not None or self.mlp_out is not None

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        nq, nkv = self.num_heads, self.num_kv_heads
        if nq % nkv:
            raise LeanmlError(f"{self.model_type}: {nq} query heads do not split into {nkv} key/value groups")
        return nq // nkv

    def group_rows(self, g: int) -> dict[str, list[int]]:
        """Per producer, the output rows of key/value group ``g``: the rows of its query heads
        ``g*rep .. g*rep+rep-1`` in the query projection, its key rows and its value rows."""
        hd, rep = self.head_dim, self.group_size
        q = list(range(g * rep * hd, (g + 1) * rep * hd))
        kv = list(range(g * hd, (g + 1) * hd))
        assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
        return {self.q_proj: q, self.k_proj: kv, self.v_proj: kv}

    def attention_units(self) -> StructUnits:
        """Units of the attention pair: one per key/value group ``g``, feeding output-projection columns
        ``g*rep*hd .. (g+1)*rep*hd - 1`` (its query heads' outputs), with the rows of
        :meth:`group_rows`."""
        hd, rep = self.head_dim, self.group_size
        per_group = [self.group_rows(g) for g in range(self.num_kv_heads)]
        rows = {name: torch.tensor([r[name] for r in per_group]) for name in per_group[0]}
        cols = torch.arange(self.num_kv_heads * rep * hd).reshape(self.num_kv_heads, rep * hd)
        return StructUnits(columns=cols, rows=rows, kind="attention")

    def mlp_units(self, width: int) -> StructUnits:
        """Units of the MLP pair: unit ``j`` is column ``j`` of the consumer and, in each producer, row
        ``j`` of every fused segment (rows ``j + s * width``)."""
        idx = torch.arange(width).unsqueeze(1)
        rows = torch.cat([idx + s * width for s in range(self.mlp_segments)], dim=1)
        return StructUnits(columns=idx.clone(), rows={p: rows.clone() for p in self.mlp_in}, kind="mlp")

    def pairs(self, layer: nn.Module) -> list[Group]:
        """The structured pairs of a layer in forward order: ``attn_out`` then ``mlp_out``.

        Raises :class:`LeanmlError` for a model without a declared layout.
        """
        if not self.has_pairs:
            raise LeanmlError(
                f"no structured-pair layout for {self.model_type!r}; structured methods support: "
                f"{', '.join(structured_model_types())} (unstructured and N:M methods work on any decoder)"
            )
        groups = []
        if self.o_proj is not None and self.v_proj is not None:
            units = self.attention_units()
            groups.append(Group("attn_out", {self.o_proj: layer.get_submodule(self.o_proj)},
                                producers={p: layer.get_submodule(p) for p in units.rows},
                                units=units,
                                consumer_bias_ok=self.can_hold_bias(layer, self.o_proj),
                                fixed_reason=self.fixed_heads_reason()))
        if self.mlp_out is not None:
            consumer = layer.get_submodule(self.mlp_out)
            groups.append(Group("mlp_out", {self.mlp_out: consumer},
                                producers={p: layer.get_submodule(p) for p in self.mlp_in},
                                units=self.mlp_units(consumer.in_features),
                                consumer_bias_ok=self.can_hold_bias(layer, self.mlp_out)))
        self._check_pairs(groups)
        return groups

    def _check_pairs(self, groups: list[Group]) -> None:
        """The declared rows and columns must fit the modules' shapes (a wrong layout fails loudly)."""
        for group in groups:
            assert group.units is not None
            consumer = next(iter(group.linears.values()))
            if int(group.units.columns.max()) >= consumer.in_features:
                raise LeanmlError(f"{self.model_type}: the {group.name} layout does not fit {group.leader} "
                                  f"({consumer.in_features} inputs)")
            for name, rows in group.units.rows.items():
                if int(rows.max()) >= group.producers[name].out_features:
                    raise LeanmlError(f"{self.model_type}: the {group.name} layout does not fit {name} "
                                      f"({group.producers[name].out_features} outputs)")

    def fixed_heads_reason(self) -> str | None:
        """Why whole key/value groups cannot be removed from this model (``None`` when they can)."""
        if self.fixed_heads is not None:
            return f"{self.model_type}: attention heads cannot be removed ({self.fixed_heads})"
        if self.num_kv_heads < 2:
            return (f"{self.model_type}: each layer has one key/value group, and removing it would remove the "
                    "whole attention")
        return None

    def bias_flag_for(self, linear: str) -> str | None:
        """The config flag that gives ``linear`` a bias in the stock class, if any."""
        for flag, names in self.bias_flags.items():
            if linear in names:
                return flag
        return None

    def can_hold_bias(self, layer: nn.Module, linear: str) -> bool:
        """Whether ``linear`` may carry a bias in a model the stock class loads."""
        mod = layer.get_submodule(linear)
        return getattr(mod, "bias", None) is not None or self.bias_flag_for(linear) is not None

    def describe(self) -> dict[str, Any]:
        return {
            "adapter": type(self).__name__,
            "model_type": self.model_type,
            "layers": len(self.layers()),
            "hidden_size": getattr(self.config, "hidden_size", None),
            "heads": getattr(self.config, "num_attention_heads", None),
            "kv_heads": self.num_kv_heads if hasattr(self.config, "num_attention_heads") else None,
            "head_dim": self.head_dim if hasattr(self.config, "num_attention_heads") else None,
            "structured_pairs": self.has_pairs,
        }


_REGISTRY: list[type[DecoderAdapter]] = []


def register(cls: type[DecoderAdapter]) -> type[DecoderAdapter]:
    """Class decorator: make a family adapter known to :func:`get_adapter`."""
    _REGISTRY.append(cls)
    return cls


def structured_model_types() -> list[str]:
    """``model_type`` values with a declared structured-pair layout."""
    import leanml.models.adapters  # noqa: F401  (registers the families)

    return sorted(t for cls in _REGISTRY for t in cls.model_types)


def adapter_class(model_type: str | None) -> type[DecoderAdapter]:
    """The family adapter of ``model_type``, or the generic :class:`DecoderAdapter`."""
    import leanml.models.adapters  # noqa: F401

    for cls in _REGISTRY:
        if model_type in cls.model_types:
            return cls
    return DecoderAdapter


def get_adapter(model: nn.Module) -> DecoderAdapter:
    """The adapter of ``model``: its family's when declared, else the generic one (unstructured methods
    only). Raises :class:`LeanmlError` for models leanml cannot handle (no layer list, mixture of
    experts, encoder-decoder)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return adapter_class(model_type)(model)
