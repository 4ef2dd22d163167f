"""What a model spec names: the bundled model, a local path, or a hub id (``org/name``)."""

from __future__ import annotations

import os

#: the models leanml ships (converted once into the cache)
BUNDLED = {"smollm2-135m"}


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` names a local path (relative, absolute, a weight file) rather than a hub id ``org/name``."""
    return (
        spec.startswith((".", "/", "~"))
        or os.sep in spec.strip("/").split("/", 1)[-1]
        or spec.count("/") != 1
        or spec.endswith((".gguf", ".safetensors", ".bin"))
    )
