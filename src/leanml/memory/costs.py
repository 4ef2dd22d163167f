"""The cost model a profile holds: what each activation group costs to keep, recompute or compress.

:class:`Profile` (made by :func:`~leanml.memory.profiler.profile_step`) holds per group a
:class:`GroupStats` (bytes saved, inputs, forward time, selective-checkpoint costs, and per compressor a
:class:`CompressStat`) and per layer its compiled variants (:class:`CompiledStat`). Costs not measured
are derived here: layers whose compressors or compiled runs were skipped copy the nearest measured
layer's, scaled by bytes (:func:`copy_unmeasured`, :func:`copy_unmeasured_compiled`), and
:func:`pool_timings` replaces each layer's times by the median over layers doing the same work.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import asdict, dataclass, field

from leanml.memory.structure import GroupKey


@dataclass
class CompressStat:
    """What one compressor does to one group: bytes kept, time added, error."""

    payload_bytes: int
    pack_s: float
    unpack_s: float
    error: float  # largest relative error over the group's tensors
    max_out_bytes: int  # largest decompressed tensor (transient in backward)

    def scaled(self, scale: float) -> CompressStat:
        """The same compressor on a group ``scale`` times as large: payload and times scale, error and the
        largest output stay."""
        return CompressStat(int(self.payload_bytes * scale), self.pack_s * scale, self.unpack_s * scale, self.error,
                            self.max_out_bytes)


@dataclass
class GroupStats:
    """Profile of one activation group."""

    layer: int | None
    child: str
    kind: str
    bytes: int = 0
    n_tensors: int = 0
    max_tensor_bytes: int = 0
    mask_bytes: int = 0
    input_bytes: int = 0
    fwd_s: float = 0.0
    sel_saved_bytes: int = 0  # outputs a selective checkpoint keeps (matmuls, attention)
    sel_recompute_s: float = 0.0  # time of the ops it recomputes (pointwise)
    outlier_ratio: float = 0.0
    compress: dict[str, CompressStat] = field(default_factory=dict)

    @property
    def key(self) -> GroupKey:
        return GroupKey(self.layer, self.child)

    @property
    def label(self) -> str:
        return self.key.label()


@dataclass
class CompiledStat:
    """One layer run by compiled kernels at one recomputation budget of the compiler."""

    budget: float
    bytes: int  # what the compiled graph saves (storages no other layer owns)
    max_tensor_bytes: int
    time_s: float  # compiled forward+backward minus the eager one (negative when compiled is faster)
    compile_s: float  # the first call: compilation, or loading it from the compile cache
    compress: dict[str, CompressStat] = field(default_factory=dict)


@dataclass
class Profile:
    """Result of :func:`profile_step`."""

    groups: dict[GroupKey, GroupStats]
    n_layers: int
    layer_input_bytes: list[int]
    layer_fwd_s: list[float]
    peak_bytes: int  # unoptimized peak: every storage one step saves (pre + all groups + post)
    compressors: tuple[str, ...]
    profile_peak_bytes: int = 0  # measured peak of live activations while profiling
    profile_s: float = 0.0
    compiled: dict[int, list[CompiledStat]] = field(default_factory=dict)
    layer_eager_s: list[float] = field(default_factory=list)  # eager forward+backward per layer (0: not timed)
    compile_error: str | None = None
    shape: str = ""
    measured_layers: list[int] = field(default_factory=list)  # layers whose compressors / compiled runs were timed
    layer_kinds: list[str] = field(default_factory=list)  # class name of each block

    def layer_groups(self, layer: int) -> list[GroupStats]:
        return [g for k, g in self.groups.items() if k.layer == layer]

    def to_json(self) -> dict:
        return {
            "n_layers": self.n_layers,
            "peak_bytes": self.peak_bytes,
            "profile_peak_bytes": self.profile_peak_bytes,
            "profile_s": self.profile_s,
            "shape": self.shape,
            "layer_input_bytes": self.layer_input_bytes,
            "layer_fwd_s": self.layer_fwd_s,
            "layer_eager_s": self.layer_eager_s,
            "compile_error": self.compile_error,
            "measured_layers": self.measured_layers,
            "layer_kinds": self.layer_kinds,
            "compiled": {str(k): [asdict(c) for c in v] for k, v in self.compiled.items()},
            "groups": [asdict(g) | {"label": g.label} for g in self.groups.values()],
        }



def _nearest(measured: set[int], layer: int) -> int | None:
    return min(measured, key=lambda m: (abs(m - layer), m)) if measured else None


def copy_unmeasured(groups: dict[GroupKey, GroupStats], measured: set[int]) -> None:
    """Layers whose compressors were not measured copy the nearest measured layer's stats, scaled by bytes."""
    for key, g in groups.items():
        if key.layer is None or key.layer in measured:
            continue
        ref = _nearest(measured, key.layer)
        src = groups.get(GroupKey(ref, key.child)) if ref is not None else None
        if src is not None and src.bytes > 0:
            scale = g.bytes / src.bytes
            g.outlier_ratio = src.outlier_ratio
            g.compress = {n: s.scaled(scale) for n, s in src.compress.items()}


def copy_unmeasured_compiled(compiled: dict[int, list[CompiledStat]], eager_s: list[float], n_layers: int,
                             groups: dict[GroupKey, GroupStats]) -> None:
    """Compiled variants of unmeasured layers: the nearest measured layer's, scaled by the layers' bytes."""
    done = set(compiled)
    for layer in range(n_layers):
        if layer in done:
            continue
        ref = _nearest(done, layer)
        if ref is None:
            continue
        mine = sum(g.bytes for k, g in groups.items() if k.layer == layer)
        theirs = sum(g.bytes for k, g in groups.items() if k.layer == ref) or 1
        scale = mine / theirs
        eager_s[layer] = eager_s[ref] * scale
        compiled[layer] = [
            CompiledStat(c.budget, int(c.bytes * scale), c.max_tensor_bytes, c.time_s * scale, 0.0,
                         {n: s.scaled(scale) for n, s in c.compress.items()})
            for c in compiled[ref]
        ]



def layer_classes(profile: Profile) -> list[list[int]]:
    """Layers that do the same work: same block class, same input bytes and the same groups with the same
    saved bytes (the decoder layers of one model, on one batch shape). Each class in layer order."""
    classes: dict[tuple, list[int]] = {}
    for layer in range(profile.n_layers):
        kind = profile.layer_kinds[layer] if layer < len(profile.layer_kinds) else ""
        sig = (kind, profile.layer_input_bytes[layer],
               tuple(sorted((g.child, g.bytes) for g in profile.layer_groups(layer))))
        classes.setdefault(sig, []).append(layer)
    return list(classes.values())


def _pool_compress(own: dict[str, CompressStat], stats: list[dict[str, CompressStat]]) -> dict[str, CompressStat]:
    """``own``'s compressors with pack and unpack times the median over ``stats`` (one dict per layer of a
    class) and the class's largest error; payload and output bytes stay ``own``'s."""
    out = {}
    for name, mine in own.items():
        same = [s[name] for s in stats if name in s] or [mine]
        out[name] = CompressStat(mine.payload_bytes, statistics.median([s.pack_s for s in same]),
                                 statistics.median([s.unpack_s for s in same]), max(s.error for s in same),
                                 mine.max_out_bytes)
    return out


def pool_timings(profile: Profile) -> Profile:
    """A copy of ``profile`` whose times are pooled over layers that do the same work.

    Each layer's times come from a few short runs on a machine whose speed drifts, so two identical
    decoder layers can be timed far apart and the planner would treat them differently (run one
    compiled and its twin eager) for no real reason. Within each class of :func:`layer_classes`, every
    time (group forward and selective-recompute times, compressor pack/unpack times, the layer's forward,
    its eager forward+backward and its compiled ones against it) becomes the median over the class's
    measured layers. Bytes and outlier ratios stay per layer; a compressor's error becomes
    the largest in the class."""
    out = copy.deepcopy(profile)
    measured = set(profile.measured_layers) or set(range(profile.n_layers))
    for cls in layer_classes(profile):
        if len(cls) < 2:
            continue
        ref = [layer for layer in cls if layer in measured] or cls
        for child in {g.child for g in profile.layer_groups(cls[0])}:
            src = [profile.groups[GroupKey(layer, child)] for layer in ref]
            fwd = statistics.median([g.fwd_s for g in src])
            sel = statistics.median([g.sel_recompute_s for g in src])
            for layer in cls:
                g = out.groups[GroupKey(layer, child)]
                g.fwd_s, g.sel_recompute_s = fwd, sel
                g.compress = _pool_compress(g.compress, [s.compress for s in src])
        if profile.layer_fwd_s:
            fwd = statistics.median([profile.layer_fwd_s[layer] for layer in ref])
            for layer in cls:
                out.layer_fwd_s[layer] = fwd
        timed = [layer for layer in ref if layer in profile.compiled]
        for layer in cls if timed else ():
            if layer < len(out.layer_eager_s):  # kept consistent with the compiled times, which are relative to it
                out.layer_eager_s[layer] = statistics.median([profile.layer_eager_s[t] for t in timed])
            for i, c in enumerate(out.compiled.get(layer, [])):
                src_c = [profile.compiled[t][i] for t in timed]
                c.time_s = statistics.median([s.time_s for s in src_c])
                c.compress = _pool_compress(c.compress, [s.compress for s in src_c])
    return out
