"""Text-supervised training of an extractor + soft product quantizer (the content-ID model).

The model maps content (an image, or a content vector) to a continuous ``D``-dim vector ``x``, then
quantizes it into ``M`` codes of ``K`` values: ``codebook="pq"`` (:class:`SoftProductQuantizer`) or
``codebook="rq"`` (:class:`SoftResidualQuantizer`, ``M`` coarse-to-fine levels). ``x`` is L2-normalized in
``norm_groups`` equal groups (1: as a whole; default: ``M`` for jointly trained pq, else 1), which does not
depend on the codebook of a post-hoc design: every post-hoc design of one seed and ``norm_groups`` shares one
continuous vector and differs only in its codes. Training makes the *quantized* vector predict the item's
text:

- ``loss="infonce"`` (default): image <-> text InfoNCE with a frozen MiniLM text embedding and two
  small trainable projections; captions that are identical count as positives of each other.
- ``loss="tokens"``: multi-label classification of the caption's tokens (bag of words) from the
  quantized vector.

With ``recon_weight > 0`` a small decoder also reconstructs the (per-dimension standardized) input from
the quantized vector, as RQ-VAE semantic IDs do: text alone rewards only what captions say (a class and
coarse attribute words), and items with the same caption collapse onto one code; reconstruction keeps
the content detail the captions leave out. The text supervision stays.

Schedule: ``warmup_epochs`` without quantization (heads see ``x``), then k-means initialization of the
codebooks on ``x`` of all training items, then ``epochs`` with the soft quantizer and ``tau`` annealed
geometrically from ``tau_start`` to ``tau_end``. With ``joint=False`` the encoder trains all epochs on the
continuous ``x`` and the codebooks are fitted afterwards by k-means (per sub-space, or level by level on
the residuals: "RQ-KMeans"), so the codes approximate the supervised vector as closely as ``M``, ``K``
allow and no level can collapse during training. With ``reseed_dead`` (default), after every quantized
epoch but the last, codewords that no training item uses are re-seeded at randomly drawn encoded items
(their sub-vector, or the residual of their level); the report counts them per epoch.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from leanml.ctr.content_ids.config import ContentIDConfig
from leanml.ctr.content_ids.encoders import ContentEncoder, MLPEncoder, SmallCNN
from leanml.ctr.content_ids.quantizer import QUANTIZERS, anneal_tau, reseed_dead_codes, usage_stats
from leanml.errors import LeanmlError
from leanml.finite import check_finite_step, check_finite_tensors, lr_hint
from leanml.outputs import atomic_dir, write_json

STOPWORDS = frozenset("a an the and or of with in on for to is it this that its by at as".split())


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric tokens of ``text`` without stopwords."""
    return [t for t in re.findall(r"[a-z0-9]+", text.lower()) if t not in STOPWORDS and len(t) > 1]


def build_vocab(captions: Sequence[str], max_size: int = 512, min_count: int = 2) -> list[str]:
    """The ``max_size`` most frequent caption tokens seen at least ``min_count`` times."""
    counts = Counter(t for c in captions for t in set(tokenize(c)))
    return [t for t, n in counts.most_common(max_size) if n >= min_count]


def token_targets(captions: Sequence[str], vocab: Sequence[str]) -> np.ndarray:
    """Multi-hot ``(N, V)`` float32 matrix of caption tokens."""
    index = {t: i for i, t in enumerate(vocab)}
    out = np.zeros((len(captions), len(vocab)), dtype=np.float32)
    for row, c in enumerate(captions):
        for t in tokenize(c):
            if t in index:
                out[row, index[t]] = 1.0
    return out


class ContentIDModel(nn.Module):
    """Extractor + soft product quantizer + text-supervision heads.

    ``embed(x)`` gives the continuous vector (L2-normalized in ``norm_groups`` groups: see
    ``ContentIDConfig.norm_groups``), ``forward(x, tau)`` the quantized vector and the soft assignment,
    ``codes(x)`` the hard ``(N, M)`` codes. The quantizer's parameters are created last, so the encoder and
    heads of one seed start from the same weights whatever the codebook design.
    """

    def __init__(self, config: ContentIDConfig, backbone: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        if backbone is None:
            backbone = (SmallCNN(width=config.width) if config.kind == "cnn"
                        else MLPEncoder(config.in_dim, 8 * config.width))
        self.norm_groups = config.norm_groups or (config.m if config.codebook == "pq" and config.joint else 1)
        self.encoder = ContentEncoder(backbone, config.dim)
        self.img_proj = nn.Linear(config.dim, config.proj_dim)
        self.txt_proj = nn.Linear(config.text_dim, config.proj_dim)
        self.token_head = nn.Linear(config.dim, max(len(config.vocab), 1))
        if config.recon_weight > 0:
            if config.recon_dim <= 0:
                raise LeanmlError("recon_weight > 0 needs recon_dim (the flattened input size)")
            self.decoder = nn.Sequential(nn.Linear(config.dim, 256), nn.ReLU(), nn.Linear(256, config.recon_dim))
            self.register_buffer("recon_mean", torch.zeros(config.recon_dim))
            self.register_buffer("recon_std", torch.ones(config.recon_dim))
        self.quantizer = QUANTIZERS[config.codebook](config.dim, config.m, config.k, config.straight_through)

    def recon_loss(self, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Mean squared error of the decoder's reconstruction of the standardized input ``x``."""
        target = (x.reshape(len(x), -1) - self.recon_mean) / self.recon_std
        return F.mse_loss(self.decoder(v), target)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)
        n, d = z.shape
        return F.normalize(z.reshape(n, self.norm_groups, d // self.norm_groups), dim=-1).reshape(n, d)

    def forward(self, x: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(continuous, quantized, probs)``."""
        z = self.embed(x)
        q, probs = self.quantizer(z, tau)
        return z, q, probs

    @torch.no_grad()
    def codes(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantizer.codes(self.embed(x))


def info_nce(img: torch.Tensor, txt: torch.Tensor, group: torch.Tensor, temperature: float) -> torch.Tensor:
    """Symmetric InfoNCE between normalized ``img`` and ``txt`` ``(B, P)``; rows with equal ``group``
    (identical captions) are all positives: ``-log(sum_pos exp(s) / sum_all exp(s))``."""
    logits = F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T / temperature
    pos = group[:, None] == group[None, :]
    neg_inf = torch.finfo(logits.dtype).min
    i2t = torch.logsumexp(logits, 1) - torch.logsumexp(logits.masked_fill(~pos, neg_inf), 1)
    t2i = torch.logsumexp(logits.T, 1) - torch.logsumexp(logits.T.masked_fill(~pos, neg_inf), 1)
    return 0.5 * (i2t.mean() + t2i.mean())


def _supervision_loss(
    model: ContentIDModel, v: torch.Tensor, text: torch.Tensor | None, group: torch.Tensor | None,
    tokens: torch.Tensor | None,
) -> torch.Tensor:
    if model.config.loss == "infonce":
        assert text is not None and group is not None
        return info_nce(model.img_proj(v), model.txt_proj(text), group, model.config.temperature)
    assert tokens is not None
    return F.binary_cross_entropy_with_logits(model.token_head(v), tokens)


@torch.no_grad()
def embed_all(model: ContentIDModel, inputs: torch.Tensor, batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Continuous vectors ``(N, D)`` and hard codes ``(N, M)`` for ``inputs`` (eval mode)."""
    model.eval()
    device = next(model.parameters()).device
    zs, cs = [], []
    for i in range(0, len(inputs), batch_size):
        z = model.embed(inputs[i : i + batch_size].to(device))
        zs.append(z.cpu())
        cs.append(model.quantizer.codes(z).cpu())
    return torch.cat(zs).numpy(), torch.cat(cs).numpy().astype(np.int64)


def fit_content_ids(
    inputs: torch.Tensor,
    captions: Sequence[str],
    config: ContentIDConfig,
    text_emb: np.ndarray | None = None,
    backbone: nn.Module | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> tuple[ContentIDModel, dict[str, Any]]:
    """Train a content-ID model on ``inputs`` (images ``(N, H, W)`` or vectors ``(N, F)``) and captions.

    ``text_emb`` (``(N, 384)``) is required for ``loss="infonce"`` (see ``encoders.embed_texts``).
    Returns the model (eval mode) and a report with per-epoch losses and codebook usage statistics.
    """
    config, model = _seeded_model(inputs, captions, config, backbone, device)
    targets = _targets(captions, config, text_emb, len(inputs))
    history = _Training(model, inputs, targets, config, device).run(progress)
    if not config.joint:  # post-hoc: codebooks are k-means (per sub-space, or level by level) of the final vectors
        z_all, _ = embed_all(model, inputs)
        model.quantizer.init_kmeans(torch.as_tensor(z_all).to(device), iters=50, seed=config.seed)
    model.eval()
    _, codes = embed_all(model, inputs)
    report = {
        "config": asdict(config),
        "n_items": len(inputs),
        "history": history,
        "usage": usage_stats(codes, config.k).as_dict(),
        "final_loss": history[-1]["loss"] if history else float("nan"),
    }
    if config.loss == "infonce":
        report["caption_top1"] = caption_retrieval_top1(model, inputs, targets.text, targets.group)
    return model, report


def _seeded_model(inputs: torch.Tensor, captions: Sequence[str], config: ContentIDConfig,
                  backbone: nn.Module | None, device: torch.device | str) -> tuple[ContentIDConfig, ContentIDModel]:
    """The checked inputs' config (scheduled, with its caption vocabulary and reconstruction size) and the
    model it builds, made after seeding torch with ``config.seed``."""
    config = config.scheduled()
    n = len(inputs)
    if len(captions) != n:
        raise LeanmlError(f"{n} inputs but {len(captions)} captions; every item needs exactly one caption")
    if n < config.k:
        raise LeanmlError(f"only {n} items to fit K={config.k} codewords; use more items or a smaller K")
    torch.manual_seed(config.seed)
    if config.loss == "tokens" and not config.vocab:
        config = replace(config, vocab=build_vocab(captions))  # the model's own copy; the caller's stays as given
        if not config.vocab:
            raise LeanmlError("captions have no token seen twice; token supervision needs repeated words")
    if config.recon_weight > 0:
        config = replace(config, recon_dim=int(inputs[0].numel()))
    model = ContentIDModel(config, backbone).to(device)
    if config.recon_weight > 0:
        flat = inputs.reshape(n, -1).float()
        model.recon_mean.copy_(flat.mean(0).to(device))
        std = flat.std(0)
        # no blow-up on near-constant dims
        model.recon_std.copy_(std.clamp_min(0.5 * float(std.mean()) + 1e-6).to(device))
    return config, model


@dataclass(frozen=True)
class _Targets:
    """What supervises each item: its caption's ``group`` (items with the same caption), its caption
    embedding (``text``, for InfoNCE) and its caption-token targets (``tokens``)."""

    group: torch.Tensor
    text: torch.Tensor | None
    tokens: torch.Tensor | None


def _targets(captions: Sequence[str], config: ContentIDConfig, text_emb: np.ndarray | None, n: int) -> _Targets:
    _, group_np = np.unique(np.asarray(list(captions), dtype=object), return_inverse=True)
    group = torch.as_tensor(group_np.ravel(), dtype=torch.long)
    text = None
    if config.loss == "infonce":
        if text_emb is None or len(text_emb) != n:
            raise LeanmlError("loss='infonce' needs one text embedding per item (embed_texts(captions))")
        text = torch.as_tensor(np.asarray(text_emb), dtype=torch.float32)
    tokens = torch.as_tensor(token_targets(captions, config.vocab)) if config.loss == "tokens" else None
    return _Targets(group, text, tokens)


class _Training:
    """The epochs of :func:`fit_content_ids`: warm-up epochs unquantized, then (``joint``) quantized with
    an annealed temperature; Adam, one check that every step is finite, dead codewords re-seeded."""

    def __init__(self, model: ContentIDModel, inputs: torch.Tensor, targets: _Targets, config: ContentIDConfig,
                 device: torch.device | str) -> None:
        self.model, self.inputs, self.targets, self.config, self.device = model, inputs, targets, config, device
        self.rng = np.random.default_rng(config.seed)
        self.opt = torch.optim.Adam(model.parameters(), lr=config.lr)
        self.named, self.step = list(model.named_parameters()), 0
        self.hint = lr_hint(config.lr, f"the temperatures (tau {config.tau_start:g} -> {config.tau_end:g})")
        self.gen = torch.Generator().manual_seed(config.seed)
        self.steps_per_epoch = (len(inputs) + config.batch_size - 1) // config.batch_size
        self.total_q = config.epochs * self.steps_per_epoch
        self.step_q = 0
        self.total_epochs = config.warmup_epochs + config.epochs

    def run(self, progress: bool) -> list[dict[str, Any]]:
        config = self.config
        history: list[dict[str, Any]] = []
        bar = tqdm(total=self.total_epochs * self.steps_per_epoch, desc=f"content-ids {config.loss}",
                   disable=not progress, leave=False)
        for epoch in range(self.total_epochs):
            history.append(self.epoch(epoch, bar))
        bar.close()
        return history

    def epoch(self, epoch: int, bar: Any) -> dict[str, Any]:
        """One pass over the items in a seeded order; its history entry."""
        config, model, inputs = self.config, self.model, self.inputs
        quantize = config.joint and epoch >= config.warmup_epochs
        if quantize and epoch == config.warmup_epochs:
            z_all, _ = embed_all(model, inputs)
            model.quantizer.init_kmeans(torch.as_tensor(z_all).to(self.device), seed=config.seed)
        model.train()
        perm = self.rng.permutation(len(inputs))
        losses, tau = [], config.tau_start
        for i in range(0, len(inputs), config.batch_size):
            idx = torch.as_tensor(perm[i : i + config.batch_size])
            if len(idx) < 2:
                continue
            loss, tau = self.loss(idx, quantize, tau)
            self.opt.zero_grad()
            loss.backward()
            self.step += 1
            check_finite_step(loss, self.named, self.step, self.hint, "content-ID training")
            self.opt.step()
            losses.append(loss.item())
            bar.update(1)
        entry: dict[str, Any] = {"epoch": epoch, "quantized": quantize, "tau": tau, "loss": float(np.mean(losses))}
        if quantize and config.reseed_dead and epoch < self.total_epochs - 1:
            entry["reseeded"] = reseed_dead(model, inputs, self.gen, self.opt)
        return entry

    def loss(self, idx: torch.Tensor, quantize: bool, tau: float) -> tuple[torch.Tensor, float]:
        """The training loss of the items ``idx`` and the temperature it used (``tau`` when not quantized)."""
        config, model, device, t = self.config, self.model, self.device, self.targets
        x = self.inputs[idx].to(device)
        if quantize:
            tau = anneal_tau(self.step_q, self.total_q, config.tau_start, config.tau_end)
            z, v, probs = model(x, tau)
            with torch.no_grad():
                hard = model.quantizer.decode(probs.argmax(-1))
            commit = ((z - hard) ** 2).sum(-1).mean() / config.m  # mean squared error per code
            self.step_q += 1
        else:
            v, commit = model.embed(x), torch.zeros((), device=device)
        loss = _supervision_loss(
            model, v,
            t.text[idx].to(device) if t.text is not None else None,
            t.group[idx].to(device),
            t.tokens[idx].to(device) if t.tokens is not None else None,
        ) + config.commit_weight * commit
        if config.recon_weight > 0:
            loss = loss + config.recon_weight * model.recon_loss(v, x)
        return loss, tau


@torch.no_grad()
def reseed_dead(model: ContentIDModel, inputs: torch.Tensor, generator: torch.Generator,
                optimizer: torch.optim.Optimizer | None = None) -> int:
    """Re-seed the codewords no item of ``inputs`` uses (hard codes); returns how many were re-seeded.

    With ``optimizer``, the re-seeded codewords' rows of its per-parameter state (Adam's moments) are
    zeroed too: a re-seeded codeword starts fresh instead of being pushed by the moments of the dead one.
    Without that, training diverged in its last epochs on MovieLens (pq M4 K16 joint: loss 0.21 -> 3.26,
    30 of 64 codewords dead at the end).
    """
    z, codes = embed_all(model, inputs)
    q = model.quantizer
    counts = torch.stack([torch.bincount(torch.as_tensor(codes[:, j]), minlength=q.k) for j in range(q.m)])
    level_in = q.level_inputs(torch.as_tensor(z).to(q.codebooks.device)).cpu()
    total = reseed_dead_codes(q.codebooks.data, counts, level_in, generator)
    if optimizer is not None and total:
        dead = (counts == 0).to(q.codebooks.device)
        for value in optimizer.state.get(q.codebooks, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == q.codebooks.shape:
                value[dead] = 0
    return total


@torch.no_grad()
def caption_retrieval_top1(model: ContentIDModel, inputs: torch.Tensor, text: torch.Tensor,
                           group: torch.Tensor) -> float:
    """Fraction of items whose hard-quantized vector retrieves its own caption among all distinct captions."""
    model.eval()
    device = next(model.parameters()).device
    uniq_group, first = np.unique(group.numpy(), return_index=True)
    txt = F.normalize(model.txt_proj(text[first].to(device)), dim=-1)
    hits = 0
    for i in range(0, len(inputs), 1024):
        _, q, _ = model(inputs[i : i + 1024].to(device), 1.0)
        sim = F.normalize(model.img_proj(q), dim=-1) @ txt.T
        hits += int((torch.as_tensor(uniq_group, device=device)[sim.argmax(1)] == group[i : i + 1024].to(device)).sum())
    return hits / len(inputs)


def save_content_model(model: ContentIDModel, out: str | Path, report: dict[str, Any], overwrite: bool = False,
                       *, out_flag: str | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` and ``report.json`` into ``out`` atomically. ``out_flag``:
    the option that set ``out``, named when the disk is too full (default: "output folder")."""
    from safetensors.torch import save_file

    from leanml.faults import check_space

    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    check_finite_tensors(state.items(), "the content-ID model")
    # before anything is written
    check_space(Path(out).expanduser().absolute().parent, sum(t.numel() * t.element_size() for t in state.values()),
                "the content-ID model", f"free space there or choose another {out_flag or 'output folder'}")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(asdict(model.config), indent=2) + "\n")
        save_file(state, str(tmp / "model.safetensors"))
        write_json(tmp / "report.json", report)
    return Path(out)


def load_content_model(path: str | Path, device: torch.device | str = "cpu") -> ContentIDModel:
    """Load a model written by :func:`save_content_model` (built-in backbones only)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        raise LeanmlError(f"{path} is not a content-ID model folder (config.json + model.safetensors); "
                          "create one with `leanml ctr content-ids fit`")
    fields = json.loads((path / "config.json").read_text())
    # folders written before the option existed normalized every pq design per sub-vector
    fields.setdefault("norm_groups", fields.get("m", 4) if fields.get("codebook", "pq") == "pq" else 1)
    config = ContentIDConfig(**fields)
    model = ContentIDModel(config)
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model.to(device).eval()
