"""The planning problem of one profile: which options each activation group may take, at what cost.

:func:`build_problem` turns a :class:`~leanml.memory.costs.Profile` into a
:class:`~leanml.memory.plan_types.Problem`: per group retain, recompute (whole or selective) and every
compressor within its error cap; per layer its checkpoint and (when profiled) its compiled variants;
and the ``post`` group's options. It also returns the option names in the problem's order, which is
how a solution maps back to groups.
"""

from __future__ import annotations

from leanml.memory.compiled import compiled_option_name
from leanml.memory.costs import Profile
from leanml.memory.plan_types import LayerSpec, Option, Problem
from leanml.memory.runtime import BITPACK, RECOMPUTE, RETAIN, SELECTIVE
from leanml.memory.structure import SELF, GroupKey


def _compiled_alternatives(profile: Profile, layer: int, max_error: float, caps: dict[str, float]) -> list[Option]:
    """Whole-layer options of a layer run by compiled kernels: per compile budget, retained or compressed."""
    stats = profile.compiled.get(layer, [])
    if not stats:
        return []
    full = max(c.bytes for c in stats)
    opts = []
    for c in stats:
        # recomputation inside the compiled backward lives while this layer's backward runs
        opts.append(Option(compiled_option_name(c.budget), c.bytes, max(0.0, full - c.bytes), c.time_s))
        for name, st in c.compress.items():
            if st.error > caps.get(name, max_error) or st.payload_bytes >= c.bytes:
                continue
            opts.append(Option(compiled_option_name(c.budget, name), st.payload_bytes, full,
                               c.time_s + st.pack_s + st.unpack_s, st.error))
    return opts


def build_problem(profile: Profile, max_error: float, caps: dict[str, float] | None = None,
                  compress_head: bool = False) -> tuple[Problem, list[list[tuple[GroupKey, list[str]]]], list[str]]:
    """Planner instance from a profile. Returns the problem, per layer the (group, option names) in the
    problem's order, and the option names of the ``post`` group. Each layer's whole-layer options are
    its checkpoint, then (when the profile has them) its compiled variants."""
    caps = caps or {}
    layers: list[LayerSpec] = []
    names: list[list[tuple[GroupKey, list[str]]]] = []
    for layer in range(profile.n_layers):
        specs, layer_names = [], []
        total = 0
        biggest = 0
        for g in profile.layer_groups(layer):
            if g.bytes == 0:
                continue
            total += g.bytes
            biggest = max(biggest, g.max_tensor_bytes)
            opts = [Option(RETAIN, g.bytes)]
            if g.child != SELF:
                opts.append(Option(RECOMPUTE, g.input_bytes, g.bytes + g.max_tensor_bytes, g.fwd_s))
                sel_keep = g.input_bytes + g.sel_saved_bytes
                if sel_keep < g.bytes:  # recompute only the pointwise ops, keep matmul/attention outputs
                    opts.append(Option(SELECTIVE, sel_keep, g.bytes, g.sel_recompute_s))
            for name, st in g.compress.items():
                lossy = name != BITPACK
                if lossy and st.error > caps.get(name, max_error):
                    continue
                if st.payload_bytes >= g.bytes:
                    continue
                opts.append(Option(name, st.payload_bytes, st.max_out_bytes, st.pack_s + st.unpack_s, st.error))
            specs.append(opts)
            layer_names.append((g.key, [o.name for o in opts]))
        ck = None
        if specs:
            fwd = sum(g.fwd_s for g in profile.layer_groups(layer)) if profile.layer_fwd_s[layer] == 0 else \
                profile.layer_fwd_s[layer]
            ck = Option("checkpoint", profile.layer_input_bytes[layer], total + biggest, fwd)
        layers.append(LayerSpec(specs, ck, _compiled_alternatives(profile, layer, max_error, caps) if specs else []))
        names.append(layer_names)
    pre = profile.groups.get(GroupKey(None, "pre"))
    post = profile.groups.get(GroupKey(None, "post"))
    post_opts: list[Option] = []
    post_names: list[str] = []
    if post is not None and post.bytes:
        post_opts.append(Option(RETAIN, post.bytes))
        post_names.append(RETAIN)
        if compress_head:
            for name, st in post.compress.items():
                if (name == BITPACK or st.error <= caps.get(name, max_error)) and st.payload_bytes < post.bytes:
                    post_opts.append(Option(name, st.payload_bytes, st.max_out_bytes, st.pack_s + st.unpack_s,
                                            st.error))
                    post_names.append(name)
    return Problem(layers, float(pre.bytes if pre else 0), post_opts), names, post_names
