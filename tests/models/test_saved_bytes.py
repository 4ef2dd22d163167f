"""models.save.saved_bytes: the bytes a save of the model needs, against what save_pretrained really writes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from builders import tiny_llama, tiny_llama_untied
from leanml.models.save import saved_bytes


def _tensor_bytes_written(folder: Path) -> int:
    """The tensor data in the folder's safetensors files, from their headers (offsets of every tensor)."""
    total = 0
    for f in folder.glob("*.safetensors"):
        with f.open("rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(end - start for k, v in header.items() if k != "__metadata__"
                     for start, end in [v["data_offsets"]])
    return total


@pytest.mark.parametrize("make", [tiny_llama, tiny_llama_untied], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_saved_bytes_is_what_save_pretrained_writes(tmp_path: Path, make, dtype) -> None:
    model = make()
    need = saved_bytes(model, dtype)
    (model.to(dtype) if dtype is not None else model).save_pretrained(tmp_path)
    assert need == _tensor_bytes_written(tmp_path)


def test_tied_embeddings_count_once() -> None:
    tied, untied = tiny_llama(), tiny_llama_untied()
    head = untied.get_output_embeddings().weight
    assert saved_bytes(untied) - saved_bytes(tied) == head.numel() * head.element_size()
