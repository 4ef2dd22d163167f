"""2:4 models on semi-structured sparse kernels.

A 2:4-pruned model is a dense model with zeros: it runs exactly as fast as the dense one. On a CUDA GPU
of compute capability 8.0 or higher (A100, H100, ...), torch can store such a weight as a
semi-structured sparse tensor (half the values plus 2-bit position metadata) and multiply with
cuSPARSELt or CUTLASS kernels. :func:`to_sparse_kernels` converts every 2:4 ``nn.Linear`` of the decoder
layers in place; ``leanml.models.load_model(..., sparse_kernels=True)`` calls it at load time.

- A model whose decoder linears are not all 2:4 is refused (:class:`LeanmlError`).
- On the CPU it leaves the model dense and says so in one warning line.
- On a GPU below sm80, or with float32 weights, it raises a one-line :class:`LeanmlError`.
- A linear whose shape the backend cannot take (rows/columns not multiples of its minimum tile, e.g.
  32 x 64 for CUTLASS in bf16, 16 x 16 for cuSPARSELt) stays dense and is counted in the report.

:func:`check_sparse_kernels` converts a copy of a model on the GPU and compares its logits with the
masked dense model (for ``bench/gpu.py``).
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.errors import LeanmlError

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# minimum (rows, cols) of a sparse weight, each dimension a multiple of it; torch's own tables win when present
MIN_SHAPE = {"cutlass": {torch.float16: (32, 64), torch.bfloat16: (32, 64), torch.float32: (32, 32)},
             "cusparselt": {torch.float16: (16, 16), torch.bfloat16: (16, 16)}}


def nm_violations(weight: torch.Tensor, n: int = 2, m: int = 4) -> int:
    """How many groups of ``m`` consecutive inputs (per output row) keep more than ``n`` non-zeros; a
    weight whose input dimension is not a multiple of ``m`` counts as one violation."""
    if weight.dim() != 2 or weight.shape[1] % m:
        return 1
    nonzero = (weight.detach() != 0).reshape(weight.shape[0], -1, m).sum(-1)
    return int((nonzero > n).sum())


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Full name to module of every linear in the decoder layers (what 2:4 pruning prunes)."""
    from leanml.models import decoder_linear_names

    modules = dict(model.named_modules())
    return {name: modules[name] for name in decoder_linear_names(model)}


def check_24(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder linears, after checking every one is 2:4 sparse; a one-line :class:`LeanmlError` if not."""
    linears = decoder_linears(model)
    bad = [name for name, mod in linears.items() if nm_violations(mod.weight)]
    if not linears or bad:
        example = f", e.g. {bad[0]}" if bad else ""
        raise LeanmlError(f"sparse_kernels needs a 2:4-sparse model, but {len(bad)} of {len(linears)} decoder linears "
                          f"are not 2:4{example}; prune with pattern 2:4 or load without sparse_kernels")
    return linears


def backend_name(backend: str | None = None) -> str:
    """``"cusparselt"`` where torch has it (its default), else ``"cutlass"``; or the one asked for."""
    if backend is not None:
        if backend not in MIN_SHAPE:
            raise LeanmlError(f"unknown sparse kernel backend {backend!r}; choose cusparselt or cutlass")
        return backend
    cusparselt = getattr(torch.backends, "cusparselt", None)
    return "cusparselt" if cusparselt is not None and cusparselt.is_available() else "cutlass"


def min_shape(backend: str, dtype: torch.dtype) -> tuple[int, int]:
    """Smallest (rows, cols) tile of a sparse weight for ``backend`` in ``dtype``."""
    cls = _subclass(backend)
    table = getattr(cls, "_DTYPE_SHAPE_CONSTRAINTS", None) if cls is not None else None
    if table and dtype in table:
        return int(table[dtype].sparse_min_rows), int(table[dtype].sparse_min_cols)
    return MIN_SHAPE[backend][dtype]


def _subclass(backend: str) -> Any:
    sparse = torch.sparse
    name = "SparseSemiStructuredTensorCUSPARSELT" if backend == "cusparselt" else "SparseSemiStructuredTensorCUTLASS"
    return getattr(sparse, name, None)


def shape_reason(shape: tuple[int, int], dtype: torch.dtype, backend: str) -> str | None:
    """Why a weight of ``shape`` cannot be a semi-structured tensor, or ``None`` if it can."""
    rows, cols = min_shape(backend, dtype)
    if shape[0] % rows or shape[1] % cols:
        return f"shape {tuple(shape)} is not a multiple of {rows} x {cols}"
    return None


def kernel_support(device: torch.device, dtype: torch.dtype) -> tuple[str, str | None]:
    """Whether weights of ``dtype`` on ``device`` can use semi-structured sparse kernels:
    ``("ok", None)``, ``("fallback", why)`` (not a GPU: run dense) or ``("error", why)`` (a GPU or
    dtype that cannot: the one-line message)."""
    if device.type != "cuda":
        return "fallback", f"semi-structured sparse kernels need a CUDA GPU, the model is on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        return "error", (f"{torch.cuda.get_device_name(device)} (sm{major}{minor}) has no semi-structured sparse "
                         "kernels, which need compute capability 8.0+ (A100, H100); load without sparse kernels")
    if dtype not in KERNEL_DTYPES:
        name = str(dtype).replace("torch.", "")
        return "error", (f"semi-structured sparse kernels take float16/bfloat16 weights, the model is {name}; "
                         "load it with dtype bfloat16")
    return "ok", None


def _converter(backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
    cls = _subclass(backend)
    if cls is None:  # pragma: no cover - torch without semi-structured sparsity
        raise LeanmlError(f"this torch ({torch.__version__}) has no semi-structured sparse tensors; upgrade torch")
    return cls.from_dense


def probe_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Run one small 2:4 matrix product through ``backend`` and compare it with the dense product:
    ``None`` when it works, else why not (one line)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 128, generator=g)
    w[:, 0::4] = 0
    w[:, 1::4] = 0
    w = w.to(device=device, dtype=dtype)
    x = torch.randn(16, 128, generator=g).to(device=device, dtype=dtype)
    try:
        out = torch.nn.functional.linear(x, _converter(backend)(w))
        ref = torch.nn.functional.linear(x, w)
        err = (out.float() - ref.float()).abs().max().item()
    except (RuntimeError, NotImplementedError) as exc:
        return f"{backend}: {str(exc).splitlines()[0][:200]}"
    scale = ref.float().abs().max().item()
    return None if err <= 0.02 * scale else f"{backend}: product off by {err:.3g} (scale {scale:.3g})"


def working_backend(device: torch.device, dtype: torch.dtype, backend: str | None = None) -> tuple[str, list[str]]:
    """The asked-for backend, or (``None``) the first of cuSPARSELt (when torch has it) and CUTLASS whose
    probe product works; with the failed probes' messages. One-line :class:`LeanmlError` if none works."""
    order = [backend_name(backend)] if backend else list(dict.fromkeys([backend_name(), "cutlass"]))
    failures = []
    for name in order:
        why = probe_backend(name, device, dtype)
        if why is None:
            return name, failures
        failures.append(why)
    raise LeanmlError(f"no semi-structured sparse kernel works on {torch.cuda.get_device_name(device)} with this torch "
                      f"({torch.__version__}): {'; '.join(failures)}; load without sparse kernels")


def to_sparse_kernels(
    model: nn.Module,
    backend: str | None = None,
    converter: Callable[[torch.Tensor], torch.Tensor] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Put every 2:4 decoder linear of ``model`` on semi-structured sparse kernels, in place.

    The model must already be on its device and in float16/bfloat16. ``backend``: ``"cusparselt"`` or
    ``"cutlass"`` (default: the first of cuSPARSELt, when torch has it, and CUTLASS whose probe product
    on a small matrix works; ``probe`` in the report lists the failed ones). ``converter`` replaces torch's conversion
    (a weight to the tensor that takes its place) and skips the device and dtype checks; tests use it
    on the CPU. Returns (and stores as ``model.leanml_sparse_kernels``) a report: ``converted`` and
    ``dense`` linear counts, ``dense_linears`` (name: reason), ``backend`` and ``note``.
    """
    linears = check_24(model)
    weight = next(iter(linears.values())).weight
    device, dtype = weight.device, weight.dtype
    report: dict[str, Any] = {"backend": None, "converted": 0, "dense": len(linears), "dense_linears": {},
                              "note": None, "probe": []}
    if converter is None:
        status, reason = kernel_support(device, dtype)
        if status == "fallback":
            report["note"] = f"{reason}; the 2:4 model runs dense"
            warnings.warn(f"leanml: {report['note']}", stacklevel=2)
            model.leanml_sparse_kernels = report
            return report
        if status == "error":
            raise LeanmlError(reason, fields=("dtype",))
        backend, report["probe"] = working_backend(device, dtype, backend)
        report["backend"] = backend
        converter = _converter(backend)
    else:
        report["backend"] = backend = backend or "custom"
    converted = 0
    for name, mod in tqdm(linears.items(), desc="sparse kernels", disable=not progress, leave=False):
        why = shape_reason(tuple(mod.weight.shape), dtype, backend) if backend in MIN_SHAPE else None
        if why is None:
            try:
                packed = converter(mod.weight.detach().contiguous())
            except RuntimeError as exc:
                raise LeanmlError(f"cannot convert {name} to a semi-structured sparse tensor "
                                  f"({str(exc).splitlines()[0]}); load without sparse kernels") from exc
            mod.weight = nn.Parameter(packed, requires_grad=False)
            converted += 1
        else:
            report["dense_linears"][name] = why
    report["converted"], report["dense"] = converted, len(linears) - converted
    if report["dense"]:
        log.info("sparse kernels: %d of %d decoder linears stay dense (shapes the %s kernels cannot take)",
                 report["dense"], len(linears), backend)
    model.leanml_sparse_kernels = report
    return report


@dataclass(frozen=True)
class Probe:
    """The random tokens :func:`check_sparse_kernels` compares logits on: ``batch_size`` rows of ``seqlen``
    tokens drawn with generator ``seed``."""

    seqlen: int = 64
    batch_size: int = 1
    seed: int = 0


@torch.no_grad()
def check_sparse_kernels(
    model: nn.Module,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    probe: Probe | None = None,
    backend: str | None = None,
    tolerance: float = 2.0,
    converter: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Convert a copy of a 2:4 ``model`` to sparse kernels on ``device`` and compare its logits with the
    masked dense model's on random tokens (``probe``: :class:`Probe`, default its defaults).

    References: the dense model in float32 (``ref32``) and in ``dtype`` (``dense``). ``ok`` when the
    sparse model's largest and mean deviations from ``ref32`` are at most ``tolerance`` times the dense
    ``dtype`` model's (so the kernels add no more error than ``dtype`` rounding already does). The
    argmax agreement with ``ref32`` is reported beside (on random weights the top logits are close, so
    it is noisy). ``model`` itself is left unchanged. ``converter``: as in :func:`to_sparse_kernels`.
    """
    device = torch.device(device)
    probe = Probe() if probe is None else probe
    seqlen, batch_size, seed = probe.seqlen, probe.batch_size, probe.seed
    check_24(model)
    work = copy.deepcopy(model).to(device=device, dtype=torch.float32).eval()
    vocab = int(work.config.vocab_size)
    ids = torch.randint(0, vocab, (batch_size, seqlen), generator=torch.Generator().manual_seed(seed)).to(device)
    ref32 = work(input_ids=ids, use_cache=False).logits.float()
    work.to(dtype)
    dense = work(input_ids=ids, use_cache=False).logits.float()
    report = to_sparse_kernels(work, backend=backend, converter=converter, progress=False)
    sparse = work(input_ids=ids, use_cache=False).logits.float()
    del work
    dense_err = (dense - ref32).abs().max().item()
    sparse_err = (sparse - ref32).abs().max().item()
    dense_mean = (dense - ref32).abs().mean().item()
    sparse_mean = (sparse - ref32).abs().mean().item()
    top32 = ref32.argmax(-1)
    dense_agree = (dense.argmax(-1) == top32).float().mean().item()
    sparse_agree = (sparse.argmax(-1) == top32).float().mean().item()
    return {
        "device": str(device), "dtype": str(dtype).replace("torch.", ""), "backend": report["backend"],
        "converted": report["converted"], "dense": report["dense"], "note": report["note"],
        "max_abs_diff_vs_dense": (sparse - dense).abs().max().item(),
        "max_abs_err_sparse": sparse_err, "max_abs_err_dense": dense_err,
        "mean_abs_err_sparse": sparse_mean, "mean_abs_err_dense": dense_mean,
        "argmax_agree_sparse": sparse_agree, "argmax_agree_dense": dense_agree, "probe": report.get("probe"),
        "ok": bool(report["converted"] > 0 and sparse_err <= tolerance * dense_err + 1e-6
                   and sparse_mean <= tolerance * dense_mean + 1e-7),
    }
