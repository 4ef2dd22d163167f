"""Shared fixtures: tiny random models built from configs, and a tiny model directory with the real
SmolLM2 tokenizer so command-line runs finish in seconds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from builders import tiny_llama

# benchmark scripts loaded by the tests import their shared helpers (bench/_common.py) from bench/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2-135M converted to safetensors (converted once into the cache)."""
    from leanml.models import bundled_dir

    return bundled_dir("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 2-layer random LLaMA with SmolLM2's real tokenizer, saved as a Hugging Face directory."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = tiny_llama(vocab=len(tok))
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def one_thread():
    """Run a test with one torch thread, restoring the previous count afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


#: fixtures that load the real bundled model or real offline data; tests using them are marked ``slow``
REAL_FIXTURES = {"smollm2_dir", "tiny_model_dir", "fashion", "fitted", "logs"}


def pytest_collection_modifyitems(config, items) -> None:
    """Mark tests on real models or data ``slow`` (``pytest -m "not slow"`` is the fast inner loop)."""
    for item in items:
        if REAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
