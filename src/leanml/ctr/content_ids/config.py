"""The options of the content-ID model and its training (:class:`ContentIDConfig`), checked once when
built; the model and its training are in :mod:`leanml.ctr.content_ids.trainer`. torch-free, so the command
line builds its options without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from leanml.config import Form, option, require

#: the codebook designs: product quantization (independent sub-spaces) and residual (coarse-to-fine levels)
CODEBOOKS = ("pq", "rq")

# training schedule of a config that leaves it unset (None): an image folder and any Python caller
DEFAULT_SCHEDULE = {"epochs": 6, "warmup_epochs": 1, "batch_size": 256}


@dataclass(frozen=True)
class ContentIDConfig:
    """Hyper-parameters of the content-ID model and its training; the command-line fields are the options
    of ``leanml ctr content-ids fit`` and ``leanml ctr train``. ``epochs``, ``warmup_epochs`` and
    ``batch_size`` left unset (None) follow the data's schedule (:meth:`scheduled`)."""

    kind: Literal["cnn", "mlp"] = option("cnn", "encoder: 'cnn' (images) or 'mlp' (content vectors)", cli=False)
    in_dim: int = option(0, "content vector length for kind='mlp'", cli=False)
    dim: int = option(32, "quantized vector length D (divisible by M for pq)")
    m: int = option(4, "IDs per ad: sub-spaces (pq) or levels (rq)", flag="--M")
    k: int = option(16, "codewords per sub-space / level (>= 2)", flag="--K")
    codebook: Literal["pq", "rq"] = option(
        "pq", "product quantization (independent sub-spaces) or residual (coarse-to-fine levels)")
    reseed_dead: bool = option(True, "re-seed dead codewords after each quantized epoch but the last "
                                     "(or keep them)", flag="--reseed",
                               form=Form(show_default=False))
    joint: bool = option(True, "train encoder and quantizer together (default), or post hoc: the encoder alone, "
                               "then fit the codebooks by k-means",
                         form=Form(show_default=False, negative="--posthoc"))
    # L2-normalize x in this many equal groups (1: the whole vector); 0: M for jointly trained pq, else 1. Tied
    # to M before, the post-hoc raw vector depended on the codebook design (MovieLens validation raw new-ad AUC
    # 0.5845-0.6034 across the designs of one seed).
    norm_groups: int = option(0, "L2-normalize the content vector in G equal groups (1: as a whole; 0: M for "
                                 "jointly trained pq, else 1)", form=Form(metavar="G"))
    loss: Literal["infonce", "tokens"] = option("infonce", "text supervision")
    width: int = option(16, "CNN width / MLP hidden = 8 * width", cli=False)
    epochs: int | None = option(None, "quantized training epochs (default: the data's: 8 on fashion, 30 on "
                                      "movielens, 6 on an image folder)", flag="--content-epochs")
    warmup_epochs: int | None = option(None, "epochs without quantization first (default: the data's)", cli=False)
    batch_size: int | None = option(None, "batch size (default: the data's)", cli=False)
    lr: float = option(3e-3, "Adam learning rate", cli=False)
    tau_start: float = option(1.0, "soft-assignment temperature at the start", cli=False)
    # 0.02 let joint residual codes collapse in the last epochs (MovieLens rq M4 K64: 182 of 256 codewords dead,
    # caption top-1 0.017; at 0.1: 1 dead, 0.959)
    tau_end: float = option(0.1, "soft-assignment temperature at the end", cli=False)
    straight_through: bool = option(False, "hard forward, soft backward", form=Form(show_default=False))
    commit_weight: float = option(0.05, "weight of the commitment term", cli=False)
    temperature: float = option(0.1, "InfoNCE logit temperature", cli=False)
    proj_dim: int = option(64, "InfoNCE projection size", cli=False)
    recon_weight: float = option(0.0, "weight of the input reconstruction term (0: text supervision only)",
                                 cli=False)
    recon_dim: int = option(0, "flattened input size, set by fit_content_ids when recon_weight > 0", cli=False)
    vocab: list[str] = option(default_factory=list, help="caption tokens, for loss='tokens'", cli=False)
    text_dim: int = option(384, "text embedding size", cli=False)
    seed: int = option(0, "seed of the fit", cli=False)

    def __post_init__(self) -> None:
        require(self, self.kind in ("cnn", "mlp"), "kind", f"{self.kind!r} is unknown; use 'cnn' or 'mlp'")
        require(self, self.codebook in CODEBOOKS, "codebook",
                f"{self.codebook!r} is unknown; use 'pq' (product) or 'rq' (residual)")
        require(self, self.loss in ("infonce", "tokens"), "loss",
                f"{self.loss!r} is unknown; use 'infonce' or 'tokens'")
        require(self, self.k >= 2, "k", f"k={self.k}: a codebook needs at least 2 codewords; use K >= 2")
        require(self, self.m >= 1 and self.dim >= 1, ("m", "dim"), f"m={self.m} and dim={self.dim} must be >= 1")
        require(self, self.codebook != "pq" or self.dim % self.m == 0, ("m", "dim"),
                f"m={self.m} must divide the vector dim={self.dim} (D); change them")
        require(self, self.norm_groups >= 0 and not (self.norm_groups and self.dim % self.norm_groups),
                ("norm_groups", "dim"), f"norm_groups={self.norm_groups} must divide the vector dim={self.dim} "
                "(D), or be 0 (the default)")
        require(self, self.kind != "mlp" or self.in_dim > 0, ("kind", "in_dim"),
                "kind='mlp' needs in_dim > 0 (the content vector length)")
        for name in DEFAULT_SCHEDULE:
            value = getattr(self, name)
            require(self, value is None or value >= 1, name, f"must be at least 1, got {value}")

    def scheduled(self, schedule: dict[str, int] = DEFAULT_SCHEDULE) -> ContentIDConfig:
        """This config with the schedule fields it leaves unset (None) taken from ``schedule``."""
        unset = {k: v for k, v in schedule.items() if getattr(self, k) is None}
        return replace(self, **unset) if unset else self
