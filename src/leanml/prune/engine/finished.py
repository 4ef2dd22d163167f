"""Reusing the outputs of a decoder layer's finished parts during intra-layer correction."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from leanml.models.layerwise import patched_forward
from leanml.prune.base import Group

_CPU = torch.device("cpu")


def clone_tensors(obj: Any, device: torch.device | None = None) -> Any:
    """A copy of ``obj`` with every tensor inside cloned (and moved to ``device`` when given)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device, copy=True) if device is not None else obj.detach().clone()
    if isinstance(obj, (tuple, list)):
        return type(obj)(clone_tensors(o, device) for o in obj)
    return obj


def nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(nbytes(o) for o in obj)
    return 0


class FinishedParts:
    """Outputs of a layer's finished parts, reused by the later intra-layer passes of that layer.

    A *part* is a direct child of the decoder layer that holds linears (LLaMA: ``self_attn``, ``mlp``;
    OPT: ``self_attn``, ``fc1``, ``fc2``). With intra-layer correction the layer runs from its input
    once per group. Once no linear of a part is still to be pruned, its output no longer changes (the
    groups are pruned in forward order, so everything that runs before it is final too): the first pass
    that runs it completely records its output per batch (on the CPU), and the later passes and the
    final forward return a copy instead of computing it. The results are identical to recomputing
    (tested). A part called more than once per forward is never reused; recording stops at
    ``budget`` bytes.

    A part finished by a one-linear group (LLaMA: ``o_proj`` finishes ``self_attn``, ``down_proj``
    finishes ``mlp``) may also be *short-cut*: that group's statistics pass already produced the
    linear's input for every batch (:meth:`keep_input`), so once the part is final its output is the
    linear applied to that input, without recomputing what feeds it. The first batch that runs the
    part checks this exactly (the part's real output must equal the linear on the kept input, the rest
    of a tuple output being ``None``); a part that fails the check, or is called more than once per
    forward, is computed in full."""

    def __init__(self, layer: nn.Module, pending: set[str], budget: int,
                 home: torch.device = _CPU) -> None:
        self.home = home  # where recorded outputs and kept inputs live
        self.parts = {name: {f"{name}.{n}" if n else name for n, m in child.named_modules() if isinstance(m, nn.Linear)}
                      for name, child in layer.named_children()}
        self.parts = {k: v for k, v in self.parts.items() if v}
        self.modules = dict(layer.named_children())
        self.pending = set(pending)
        self.budget = budget
        self.outputs: dict[str, list[Any]] = {}
        self._recording: dict[str, list[Any]] = {}
        self._refused: set[str] = set()
        #: part -> (its finishing linear, that linear's input per batch at home)
        self._inputs: dict[str, tuple[nn.Module, list[torch.Tensor]]] = {}
        #: parts whose short cut passed the check, with the structure of their output (0: a tensor;
        #: k > 0: a tuple of k, the tensor first and ``None`` after it)
        self._cut: dict[str, int] = {}
        self._cut_refused: set[str] = set()

    def pruned(self, names: Sequence[str]) -> None:
        """``names`` are final from now on."""
        self.pending -= set(names)

    def finishes(self, group: Group) -> str | None:
        """The part that ``group`` finishes, when its input can short-cut that part: a group of one
        linear, no producers, the last pending linear of its part."""
        if len(group.linears) != 1 or group.producers:
            return None
        name = next(iter(group.linears))
        for part, lins in self.parts.items():
            if name in lins and name != part and lins & self.pending == {name} and part not in self._cut_refused:
                return part
        return None

    def keep_input(self, part: str, linear: str, b: int, x: torch.Tensor) -> bool:
        """Keep batch ``b``'s input of ``part``'s finishing ``linear`` (within the budget); ``False``
        once the budget refuses it (nothing is kept for the part then)."""
        size = nbytes(x)
        if part in self._cut_refused or size > self.budget:
            self._drop_inputs(part)
            return False
        module = self.modules[part].get_submodule(linear[len(part) + 1:])
        self._inputs.setdefault(part, (module, []))[1].append(x.detach().to(self.home, copy=x.device != self.home))
        self.budget -= size
        return True

    def _drop_inputs(self, part: str, refuse: bool = True) -> None:
        if refuse:
            self._cut_refused.add(part)
        self._cut.pop(part, None)
        _, xs = self._inputs.pop(part, (None, []))
        self.budget += sum(nbytes(x) for x in xs)

    def _linear_on_kept(self, part: str, b: int, device: torch.device) -> torch.Tensor:
        linear, xs = self._inputs[part]
        return linear(xs[b].to(device))

    def _cut_output(self, part: str, b: int, device: torch.device) -> Any:
        """The short-cut output of ``part`` for batch ``b``, in the structure the check saw."""
        y = self._linear_on_kept(part, b, device)
        size = self._cut[part]
        return y if size == 0 else (y, *([None] * (size - 1)))

    def _check_cut(self, part: str, b: int, device: torch.device, out: Any, check: dict[str, Any]) -> None:
        """Compare ``part``'s real output on batch ``b`` with its linear on the kept input (first call
        only); ``check`` collects the number of calls and the verdict (the output's structure, or None)."""
        check["calls"] += 1
        if check["calls"] > 1:
            return
        if isinstance(out, torch.Tensor):
            size, real = 0, out
        elif isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and all(o is None for o in out[1:]):
            size, real = len(out), out[0]
        else:  # any other structure: never short-cut
            return
        with torch.no_grad():
            if torch.equal(self._linear_on_kept(part, b, device), real):
                check["size"] = size

    def _end_check(self, part: str, check: dict[str, Any]) -> None:
        if check["calls"] == 0:  # not run by this pass (stopped before it): check on a later one
            return
        if check["calls"] == 1 and check["size"] is not None:
            self._cut[part] = check["size"]
        else:
            self._drop_inputs(part)

    @property
    def active(self) -> bool:
        """Whether any part is reused or may be short-cut."""
        return bool(self.outputs or self._inputs)

    def _final(self) -> list[str]:
        return [p for p, lins in self.parts.items() if not lins & self.pending and p not in self.outputs
                and p not in self._refused]

    @contextlib.contextmanager
    def batch(self, b: int, device: torch.device, record: bool = True) -> Iterator[None]:
        """During one batch's forward: reuse the recorded parts and (``record``) record the newly
        finished ones."""
        handles = []
        with contextlib.ExitStack() as stack:
            for name, outs in self.outputs.items():
                stack.enter_context(patched_forward(self.modules[name],
                                                    lambda *a, _o=outs[b], **k: clone_tensors(_o, device)))
            for name in self._cut:  # (a part whose outputs were recorded left _cut then)
                stack.enter_context(patched_forward(
                    self.modules[name], lambda *a, _p=name, **k: self._cut_output(_p, b, device)))
            finals = self._final()
            for name in finals:
                if name in self._inputs and name not in self._cut:
                    check: dict[str, Any] = {"calls": 0, "size": None}
                    handles.append(self.modules[name].register_forward_hook(
                        lambda mod, args, out, _p=name, _c=check: self._check_cut(_p, b, device, out, _c)))
                    stack.callback(self._end_check, name, check)
            for name in finals if record else []:
                rec = self._recording.setdefault(name, [])
                calls = [0]

                def hook(module: nn.Module, args: Any, out: Any, rec: list[Any] = rec,
                         calls: list[int] = calls) -> None:
                    calls[0] += 1
                    if calls[0] == 1:
                        rec.append(clone_tensors(out, self.home))

                handles.append(self.modules[name].register_forward_hook(hook))
                stack.callback(self._check_calls, name, calls, b)
            try:
                yield
            finally:
                for h in handles:
                    h.remove()

    def _check_calls(self, name: str, calls: list[int], b: int) -> None:
        if calls[0] > 1:
            self._refused.add(name)
        if calls[0] != 1 or len(self._recording.get(name, ())) != b + 1:
            self._recording.pop(name, None)

    def end_pass(self, n_batches: int) -> None:
        """After a pass over all batches: keep the parts recorded for every batch (within the budget)."""
        for name, outs in list(self._recording.items()):
            size = sum(nbytes(o) for o in outs)
            if len(outs) == n_batches and size <= self.budget:
                self.outputs[name] = outs
                self.budget -= size
                self._drop_inputs(name, refuse=False)  # the recorded outputs replace any short cut
        self._recording.clear()
