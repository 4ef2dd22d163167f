"""The options of one CTR model's training (:class:`CTRConfig`), checked once when it is built.

Feature sets (``features``, any of ``id``, ``raw``, ``visual`` joined by ``,`` or ``+``) and how each enters
the model are described in :mod:`leanml.ctr.fields`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, get_args

from leanml.config import Form, option, require
from leanml.errors import LeanmlError

#: the CTR models, by name (:data:`leanml.ctr.models.MODELS` builds them)
CTR_MODELS = ("lr", "dnn", "deepfm", "dcnv2")
FEATURE_ORDER = ("id", "raw", "visual")
VisualFields = Literal["codes", "prefix", "codes+prefix", "bag", "none"]
VISUAL_FIELDS: tuple[str, ...] = get_args(VisualFields)
IdMode = Literal["dropout", "residual"]
ID_MODES: tuple[str, ...] = get_args(IdMode)

# DCNv2's cross layers multiply small initial embeddings, so it learns slowly at 5e-3 within 3 epochs
# (measured on Fashion: visual-ID AUC on new ads 0.614 at 5e-3 vs 0.689 at 1e-2).
DEFAULT_LR = {"lr": 5e-3, "dnn": 5e-3, "deepfm": 5e-3, "dcnv2": 1e-2}


def _canonical(spec: str) -> str | None:
    parts = {p.strip().lower() for p in spec.replace("+", ",").split(",") if p.strip()}
    if not parts or parts - set(FEATURE_ORDER):
        return None
    return "+".join(p for p in FEATURE_ORDER if p in parts)


def _bad_features(spec: str) -> str:
    return f"bad features {spec!r}: use a combination of {', '.join(FEATURE_ORDER)} (e.g. id,visual)"


def parse_features(spec: str) -> str:
    """``"id,visual"`` / ``"visual+id"`` -> canonical ``"id+visual"``; raises on unknown parts."""
    canonical = _canonical(spec)
    if canonical is None:
        raise LeanmlError(_bad_features(spec))
    return canonical


@dataclass(frozen=True)
class CTRConfig:
    """CTR training hyper-parameters (the model options of ``leanml ctr train``)."""

    model: str = option("deepfm", "CTR model: lr, dnn, deepfm or dcnv2")
    features: str = option("id+visual", "any of id, raw, visual (comma-separated)")
    embed_dim: int = option(16, "embedding size of every field")
    epochs: int = option(3, "training epochs")
    batch_size: int = option(1024, "training batch size", cli=False)
    lr: float | None = option(None, "learning rate (default 5e-3; 1e-2 for dcnv2)")
    weight_decay: float = option(0.0, "Adam weight decay", cli=False)
    id_dropout: float = option(0.1, "share of training rows whose ad ID is replaced by the unseen-ad row, so the "
                                    "new-ad path is trained (DropoutNet-style)")
    id_mode: IdMode = option(
        "dropout", "the ad ID as one field trained with ID dropout, or as a correction learned on a frozen model "
                   "without it (a new ad's prediction is then exactly that model's)")
    visual_fields: VisualFields = option(
        "codes", "each code its own field (codes), prefix n-grams (prefix, for rq codebooks), both, or one pooled "
                 "bag", form=Form(show_default=False))
    prefix_buckets: int = option(1 << 16, "rows of a prefix field once K^l exceeds it (hashed beyond)", cli=False)
    codeword_vector: bool = option(False, "also feed the codes' codeword vector (a codebook lookup) through an MLP; "
                                          "needs the content-ID model, not only a visual-ID table",
                                   form=Form(show_default=False))
    content_tower: bool = option(False, "with raw and the codeword vector: one MLP over both vectors as one field, "
                                        "instead of one field each (which would interact with each other)",
                                 form=Form(show_default=False))
    seed: int = option(0, "seed of the CTR model (and of the dataset and the content-ID fit of `leanml ctr train`)")

    def __post_init__(self) -> None:
        # the message keeps "CTR model" as words (not a field name the command line would rewrite)
        require(self, self.model.lower() in CTR_MODELS, (),
                f"unknown CTR model {self.model!r}; choose one of {', '.join(sorted(CTR_MODELS))}")
        require(self, _canonical(self.features) is not None, "features", _bad_features(self.features))
        require(self, self.epochs >= 1, "epochs", f"must be at least 1, got {self.epochs}")
        require(self, self.embed_dim >= 1, "embed_dim", f"must be >= 1, got {self.embed_dim}")
        require(self, self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(self, self.lr is None or (self.lr > 0 and math.isfinite(self.lr)), "lr",
                f"must be > 0, got {self.lr}")
        require(self, self.visual_fields in VISUAL_FIELDS, "visual_fields",
                f"{self.visual_fields!r} is unknown; use one of {', '.join(VISUAL_FIELDS)}")
        require(self, self.visual_fields != "none" or self.codeword_vector, ("visual_fields", "codeword_vector"),
                "visual_fields 'none' leaves the IDs unused; add codeword_vector")
        require(self, self.id_mode in ID_MODES, "id_mode",
                f"{self.id_mode!r} is unknown; use {' or '.join(map(repr, ID_MODES))}")
        require(self, 0.0 <= self.id_dropout < 1.0, "id_dropout", f"must be in [0, 1), got {self.id_dropout}")
        require(self, not self.content_tower or ({"raw", "visual"} <= set(self.feature_set.split("+"))
                                                 and self.codeword_vector),
                ("content_tower", "features", "codeword_vector"),
                "content_tower joins the raw vector and the codeword vector into one field; it needs features "
                "with both raw and visual, and codeword_vector")

    @property
    def feature_set(self) -> str:
        """``features`` in canonical form (``"id+visual"``)."""
        return parse_features(self.features)

    @property
    def learning_rate(self) -> float:
        """``lr``, or the model's default learning rate when it is unset."""
        return self.lr if self.lr is not None else DEFAULT_LR.get(self.model.lower(), 5e-3)

    def resolved(self) -> CTRConfig:
        """The same options with the derived ones written out (canonical features, the learning rate), as
        reports record them."""
        return dataclasses.replace(self, features=self.feature_set, lr=self.learning_rate)
