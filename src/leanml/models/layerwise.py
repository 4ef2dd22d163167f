"""Running a causal LM one decoder layer at a time, so a model larger than the device still runs.

The model's parameters stay where they are (usually the CPU). The small outer modules (embeddings,
rotary tables, final norm, LM head) visit the device for the whole pass; each decoder layer visits it
for its own work; the activations between layers live on the CPU. The pruning engine and the
perplexity evaluator share these functions, so both work for models that do not fit on the device.

How the layer inputs are found without knowing the architecture: every decoder layer's ``forward`` is
temporarily replaced (an instance attribute, so the layer's other attributes stay visible to the
model's loop) by a recorder of its arguments, and the model is run on the ids. The hidden states
entering layer 0 and the keyword arguments each layer receives (attention masks, position
embeddings; different per layer in models with sliding-window layers) are what the layers need.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from leanml.models.layout import DecoderAdapter

#: keyword arguments of a layer that hold a cache: never recorded (no cache is used)
_CACHE_KEYS = ("cache", "past_key_values", "past_key_value", "layer_past")


class StopForward(Exception):
    """Raised by a recorder to skip the rest of a forward pass."""


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor inside (nested tuples, lists, dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def patched_forward(module: nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """Temporarily replace ``module.forward`` (as an instance attribute) by ``fn``."""
    had = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    module.forward = fn  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            module.forward = old  # type: ignore[method-assign]
        else:
            del module.forward


def _layer_params(layers: nn.ModuleList) -> set[int]:
    return {id(t) for t in layers.parameters()} | {id(t) for t in layers.buffers()}


@contextlib.contextmanager
def outer_on(model: nn.Module, adapter: DecoderAdapter, device: torch.device | str) -> Iterator[None]:
    """Move every parameter and buffer outside the decoder layers to ``device`` for the block, then back.

    Tied parameters stay tied (their ``.data`` moves, the ``Parameter`` objects stay).
    """
    device = torch.device(device)
    inside = _layer_params(adapter.layers())
    moved: list[tuple[Any, torch.device]] = []
    buffers: list[tuple[nn.Module, str, torch.device]] = []
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in inside or id(p) in seen or p.device == device:
            continue
        seen.add(id(p))
        moved.append((p, p.device))
        p.data = p.data.to(device)
    for module in model.modules():
        for name, b in list(module._buffers.items()):  # noqa: SLF001 - buffers are moved in place
            if b is None or id(b) in inside or b.device == device:
                continue
            buffers.append((module, name, b.device))
            module._buffers[name] = b.to(device)  # noqa: SLF001
    try:
        yield
    finally:
        for p, dev in moved:
            p.data = p.data.to(dev)
        for module, name, dev in buffers:
            module._buffers[name] = module._buffers[name].to(dev)  # noqa: SLF001


def input_device(model: nn.Module) -> torch.device:
    """Where the input embeddings live (where ids must go)."""
    emb = model.get_input_embeddings()
    return emb.weight.device if emb is not None else next(model.parameters()).device


@torch.no_grad()
def capture_layer_inputs(
    model: nn.Module, adapter: DecoderAdapter, ids: torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, list[list[dict[str, Any]]]]:
    """Run the model's embedding part on ``ids``; return the hidden states entering layer 0
    ``(n, seqlen, hidden)`` on the CPU and, for every layer, the keyword arguments it receives, one
    dict per batch of ``batch_size`` windows (``kwargs[layer][batch]``; tensors shared between layers
    are stored once). No decoder layer runs."""
    layers = adapter.layers()
    n = len(layers)
    inputs: list[torch.Tensor] = []
    per_layer: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    device = input_device(model)

    def recorder(i: int) -> Callable[..., Any]:
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            kw = {k: v for k, v in kwargs.items() if k not in _CACHE_KEYS}
            if args:
                kw["_args"] = args
            per_layer[i].append(kw)
            if i == 0:
                inputs.append(hidden_states.detach().cpu())
            if i == n - 1:
                raise StopForward
            return hidden_states

        return forward

    with contextlib.ExitStack() as stack:
        for i, layer in enumerate(layers):
            stack.enter_context(patched_forward(layer, recorder(i)))
        for start in range(0, ids.shape[0], batch_size):
            try:
                model(input_ids=ids[start : start + batch_size].to(device), use_cache=False)
            except StopForward:
                pass
    return torch.cat(inputs), per_layer


def forward_layer(layer: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """Run ``layer`` on ``x`` with recorded keyword arguments; returns its raw output."""
    kwargs = dict(kwargs)
    args = kwargs.pop("_args", ())
    return layer(x, *args, **kwargs)


def first(out: Any) -> torch.Tensor:
    """The hidden states in a layer's output (a tensor, or the first element of a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def run_layer(
    layer: nn.Module,
    x: torch.Tensor,
    kwargs_list: list[dict[str, Any]],
    batch_size: int,
    device: torch.device,
) -> torch.Tensor:
    """``layer`` applied to every batch of ``x`` (CPU) on ``device``; the outputs on the CPU.

    ``kwargs_list`` must already be on ``device``."""
    outs = []
    for b, start in enumerate(range(0, x.shape[0], batch_size)):
        outs.append(first(forward_layer(layer, x[start : start + batch_size].to(device), kwargs_list[b])).cpu())
    return torch.cat(outs)


def returns_tuple(layer: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether ``layer`` returns a tuple (older decoder layers) rather than the hidden states."""
    return isinstance(forward_layer(layer, x, kwargs), (tuple, list))


@contextlib.contextmanager
def layer_on(layer: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """The layer on ``device`` for the block, back where it was afterwards."""
    params = list(layer.parameters())
    home = params[0].device if params else device
    layer.to(device)
    try:
        yield layer
    finally:
        layer.to(home)


@torch.no_grad()
def layerwise_logits(
    model: nn.Module,
    adapter: DecoderAdapter,
    ids: torch.Tensor,
    batch_size: int,
    device: torch.device | str,
    consume: Callable[[int, torch.Tensor], None],
    progress: Callable[[Any], Any] = lambda it: it,
) -> None:
    """Compute the model's logits on ``ids`` layer by layer on ``device`` and hand each batch's logits to
    ``consume(start, logits)``; the model's parameters end where they started.

    The outer modules run on ``device``; each decoder layer visits it in turn; the hidden states
    between layers stay on the CPU. The final norm and LM head then run through the model's own forward
    with every layer replaced by a stand-in that returns the stored final hidden states.
    """
    device = torch.device(device)
    layers = adapter.layers()
    with outer_on(model, adapter, device):
        hidden, kwargs = capture_layer_inputs(model, adapter, ids, batch_size)
        tuple_out = False
        for i, layer in enumerate(progress(layers)):
            kw = [to_device(k, device) for k in kwargs[i]]
            with layer_on(layer, device):
                if i == len(layers) - 1:
                    tuple_out = returns_tuple(layer, hidden[:batch_size].to(device), kw[0])
                hidden = run_layer(layer, hidden, kw, batch_size, device)
        del kwargs
        box: dict[str, torch.Tensor] = {}

        def stand_in(hidden_states: torch.Tensor, *args: Any, **kw: Any) -> Any:
            return (box["h"],) if tuple_out else box["h"]

        in_dev = input_device(model)
        with contextlib.ExitStack() as stack:
            for layer in layers:
                stack.enter_context(patched_forward(layer, stand_in))
            for start in range(0, ids.shape[0], batch_size):
                box["h"] = hidden[start : start + batch_size].to(device)
                out = model(input_ids=ids[start : start + batch_size].to(in_dev), use_cache=False)
                consume(start, out.logits)
