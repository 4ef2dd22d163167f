"""Where the repeated blocks of a model are, and how their saved activations are grouped.

A *group* is one direct child of a block (``input_layernorm``, ``self_attn``, ``mlp`` ... in LLaMA;
``self_attn``, ``fc1``, ``fc2``, the layer norms in OPT) or the block's own operations outside its
children (``_self``: residual adds, dropout). Activations saved outside every block (embeddings, the
final norm, the LM head and the loss) form the ``pre`` and ``post`` groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from leanml.errors import LeanmlError

SELF = "_self"


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``, found by :func:`leanml.models.layout.find_layers` (a known
    decoder-layer path, else the longest ``ModuleList`` of one class).

    Raises :class:`LeanmlError` when none is found (pass ``blocks=`` explicitly then).
    """
    from leanml.models.layout import find_layers

    layers = find_layers(model)
    if layers is None:
        raise LeanmlError(
            f"could not find the repeated blocks of {type(model).__name__} (no nn.ModuleList of identical "
            "layers); pass blocks=[...] to Adacc explicitly"
        )
    return list(layers)


def kind_of(name: str) -> str:
    """Coarse kind of a group from its name: attention, mlp, norm, act, residual or other."""
    low = name.lower()
    if name == SELF:
        return "residual"
    if "attn" in low or "attention" in low:
        return "attention"
    if "norm" in low or low.startswith("ln"):
        return "norm"
    if "mlp" in low or "ffn" in low or "feed" in low or low.startswith("fc") or "proj" in low:
        return "mlp"
    if "act" in low:
        return "act"
    return "other"


@dataclass(frozen=True)
class GroupKey:
    """``layer`` is the block index (None outside blocks); ``child`` the child name, ``_self``,
    ``pre`` or ``post``."""

    layer: int | None
    child: str

    def label(self) -> str:
        return self.child if self.layer is None else f"L{self.layer}.{self.child}"


def param_storage_ptrs(model: nn.Module) -> set[int]:
    """Storage pointers of every parameter and buffer of ``model``."""
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    return ptrs


def tensors_in(obj: object) -> Iterator[torch.Tensor]:
    """Tensors found in nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


class ScopeTracker:
    """Forward hooks on blocks and their children that maintain the current :class:`GroupKey`.

    ``on_enter``/``on_exit`` callbacks get ``(key, module, args, kwargs)`` / ``(key, module, output)``.
    ``root`` (optional) is the model, whose forward starts a fresh scope; ``layers`` gives the layer index
    of each block (default ``0..len(blocks)-1``); blocks in ``skip_children`` are tracked as a whole
    (their children get no hooks: a compiled block must not have hooks traced into its graph).
    """

    def __init__(self, root: nn.Module | None, blocks: list[nn.Module], on_enter=None, on_exit=None,  # noqa: ANN001
                 layers: list[int] | None = None, skip_children: frozenset[int] | set[int] = frozenset()) -> None:
        self.stack: list[GroupKey] = []
        self.seen_block = False
        self.on_enter = on_enter
        self.on_exit = on_exit
        self._handles: list = []
        if root is not None:
            self._handles.append(root.register_forward_pre_hook(self._root_pre))
        for i, block in zip(layers if layers is not None else range(len(blocks)), blocks):
            self._add(block, GroupKey(i, SELF))
            if i in skip_children:
                continue
            for name, child in block.named_children():
                self._add(child, GroupKey(i, name))

    def reset(self) -> None:
        """Start a fresh scope (a new forward of the model)."""
        self.stack.clear()
        self.seen_block = False

    def _root_pre(self, module: nn.Module, args: tuple) -> None:
        self.reset()

    def _add(self, module: nn.Module, key: GroupKey) -> None:
        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            self.stack.append(key)
            if key.child == SELF:
                self.seen_block = True
            if self.on_enter is not None:
                self.on_enter(key, mod, args, kwargs)

        def post(mod: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            if self.on_exit is not None:
                self.on_exit(key, mod, output)
            if self.stack and self.stack[-1] == key:
                self.stack.pop()

        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))

    def current(self) -> GroupKey:
        """The group an activation saved right now belongs to."""
        if self.stack:
            return self.stack[-1]
        return GroupKey(None, "post" if self.seen_block else "pre")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
