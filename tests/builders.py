"""The tiny random-weight models the tests build (they live in :mod:`leanml.models.tiny`)."""

from leanml.models.tiny import (  # noqa: F401
    FAMILIES,
    tiny_family,
    tiny_llama,
    tiny_llama_untied,
    tiny_opt,
    tiny_opt_biased,
)


def fista_options(**changes):
    """FISTA's options with the paper's procedure as the base (K 20, T 3, no refit, no preconditioning, the
    dense target, no ridge, APG refits when asked), changed field by field; ``refine_iters`` names ``refine``."""
    from leanml.prune.methods.fista import FistaOptions

    if "refine_iters" in changes:
        changes["refine"] = changes.pop("refine_iters")
    base = dict(lam=1e-3, rounds=3, iters=20, xi=0.3, lambda_scope="row", damp=0.0, refine=0, refine_method="apg",
                tol=0.0, precondition=False, correction=1.0, ridge=0.0, refit_start=True)
    return FistaOptions(**{**base, **changes})
