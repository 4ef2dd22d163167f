"""``leanml demo --only ctr``: new-ad AUC of every feature set on Fashion-MNIST ads (about a minute on 2 cores)."""

from __future__ import annotations

import dataclasses

import torch

from leanml.ctr.content_ids.config import ContentIDConfig
from leanml.ctr.options import CTRConfig
from leanml.progress import Timer

# The design the benchmark chose on Fashion's validation split (bench/results/ctr.md): post-hoc product
# quantization, 16 codes of 64 values per ad (12 bytes) on the content vector L2-normalized in 16 groups,
# entering the model as their codeword vector; the ad ID as a residual correction on the content model (a new
# ad gets the content model's prediction).
DEMO_CONTENT = ContentIDConfig(codebook="pq", m=16, k=64, joint=False, norm_groups=16)
DEMO_CTR = CTRConfig(model="deepfm", visual_fields="none", codeword_vector=True, id_mode="residual")


def run_demo() -> None:
    """Fit content IDs on the old ads (cached after the first run), train DeepFM with each feature set
    and print AUC / gAUC on new and old ads with the bytes each ad stores."""
    from leanml.ctr.content import content_config_for, content_items, fit_dataset_content_ids
    from leanml.ctr.data import fashion_ads
    from leanml.ctr.train import run_ctr

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small models: one thread is fastest on a shared machine
    try:
        with Timer() as t:
            data = fashion_ads()
            s = data.summary()
            print(f"[ctr] Fashion-MNIST ads: {s['n_items']} ads ({s['n_new_items']} new), {s['n_users']} users, "
                  f"{s['n_train']} train / {s['n_test_new']} new-ad / {s['n_test_old']} old-ad test impressions")
            model, _ = fit_dataset_content_ids(data, content_config_for(data, DEMO_CONTENT))
            items = content_items(data, model)
            u = items.usage
            print(f"[ctr] visual IDs: {items.codebook} M={items.m}, K={items.k}; {u['unique_tuples']} distinct ID "
                  f"tuples, {u['dead_codes']} dead codes")
            rows = []
            for features in ("id", "raw", "visual", "id+raw", "id+visual"):
                _, _, rep = run_ctr(data, items, dataclasses.replace(DEMO_CTR, features=features),
                                    progress=False)
                rows.append((features, rep["bytes_per_ad"], rep["metrics"]))
        print(f"[ctr] DeepFM, {t.seconds:.0f}s")
        print(f"{'features':<11}{'bytes/ad':>9}{'AUC new':>9}{'AUC old':>9}{'gAUC new':>10}{'gAUC old':>10}")
        for features, nbytes, m in rows:
            print(f"{features:<11}{nbytes:>9g}{m['auc_new']:>9.4f}{m['auc_old']:>9.4f}{m['gauc_new']:>10.4f}"
                  f"{m['gauc_old']:>10.4f}")
        by = {f: m for f, _, m in rows}
        print(f"[ctr] id+visual vs id+raw on new ads: {by['id+visual']['auc_new'] - by['id+raw']['auc_new']:+.4f} AUC "
              f"at {rows[1][1] / rows[2][1]:.0f}x fewer bytes per ad; vs id only: "
              f"{by['id+visual']['auc_new'] - by['id']['auc_new']:+.4f}")
    finally:
        torch.set_num_threads(threads)
