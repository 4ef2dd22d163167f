"""The tiny random-weight models the tests build (they live in :mod:`leanml.models.tiny`)."""

from leanml.models.tiny import (  # noqa: F401
    FAMILIES,
    tiny_family,
    tiny_llama,
    tiny_llama_untied,
    tiny_opt,
    tiny_opt_biased,
)
