"""The layer-wise pruning engine.

The inputs of every decoder layer are captured once (:mod:`leanml.models.layerwise`); then decoder
layers are processed one at a time, each visiting ``device`` for its work while the model stays where
it is, so memory holds one layer and its activations whatever the model size. Activations between
layers live on the CPU.

Per layer the engine finds the groups to prune: for unstructured and N:M methods the linears grouped
by the input they read, found on the first calibration batch (no per-architecture code); for
structured methods the pairs declared by the model's family adapter. Statistics are gathered in one of
two ways:

- **one pass** (``intra_layer=False``; the default of magnitude, Wanda and SparseGPT, as in their
  papers): one forward of the still dense layer over the calibration batches with hooks on every
  group's first linear gathers all groups' statistics at once (plus one pass on the dense stream for
  methods that compare with the dense model); then every group is pruned.
- **intra-layer cumulative error correction** (``intra_layer=True``; FISTA's and the structured
  methods' default): groups are pruned in forward order and each group's statistics come from running
  the *partially pruned* layer, so later groups see and correct the error of earlier ones; the dense
  target (``G``/``Hd``) comes from an untouched copy of the layer on the dense stream.

Between layers: ``sequential=True`` (the default, SparseGPT's choice) feeds the pruned layer's outputs
to the next layer, and keeps a second, dense activation stream only for methods that need dense
targets (``needs_dense``); ``sequential=False`` gives every layer the dense model's inputs, which
makes layers independent (so they can be pruned in parallel by several processes).

Every pruned layer reports ``rel_output_error``, the relative squared error of its output against the
reference the method aims at, from passes the engine runs anyway: with a dense stream (methods with a
dense target in sequential mode) the dense model's activations, otherwise the dense layer's output on
the same (pruned-path) inputs.
Embeddings and ``lm_head`` are never touched.

The package, one job per module: :mod:`.walk` (:class:`LayerWalk` with its :class:`WalkSettings`, and
:func:`prune_model`, the walk as one call), :mod:`.layer` (one layer, :class:`~.layer.LayerPruning`),
:mod:`.capture` (statistics), :mod:`.allocation` (uniform, OWL and custom profiles, exact per-linear counts),
:mod:`.checkpoint` (resume), :mod:`.placement` (where the activation streams live), :mod:`.finished` (reuse of a
layer's finished parts).
"""

from leanml.prune.engine.allocation import linear_specs
from leanml.prune.engine.walk import LayerWalk, WalkSettings, check_spec, prune_model

__all__ = ["LayerWalk", "WalkSettings", "check_spec", "linear_specs", "prune_model"]
