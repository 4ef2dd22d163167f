"""``leanml demo --only ctr``: the new-ad gain of visual IDs on Fashion-MNIST ads (about a minute on 2 cores)."""

from __future__ import annotations

import torch

from leanml.utils import Timer


def run_demo() -> None:
    """Fit content IDs on the old ads (cached after the first run), train DeepFM with each feature set
    and print AUC / gAUC on new and old ads."""
    from leanml.ctr.data import fashion_ads
    from leanml.ctr.train import (
        CTRConfig,
        content_config_for,
        content_items,
        fit_dataset_content_ids,
        run_ctr,
    )

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small models: one thread is fastest on a shared machine
    try:
        with Timer() as t:
            data = fashion_ads()
            s = data.summary()
            print(f"[ctr] Fashion-MNIST ads: {s['n_items']} ads ({s['n_new_items']} new), {s['n_users']} users, "
                  f"{s['n_train']} train / {s['n_test_new']} new-ad / {s['n_test_old']} old-ad test impressions")
            model, report = fit_dataset_content_ids(data, content_config_for(data))
            items = content_items(data, model)
            u = items.usage
            print(f"[ctr] visual IDs: M={items.m}, K={items.k}; {u['unique_tuples']} distinct ID tuples, "
                  f"entropy {u['entropy_bits']:.2f} bits/sub-space, {u['dead_codes']} dead codes")
            rows = []
            for features in ("id", "raw", "visual", "id+visual"):
                _, _, rep = run_ctr(data, items, CTRConfig(model="deepfm", features=features))
                rows.append((features, rep["metrics"]))
        print(f"[ctr] DeepFM, {t.seconds:.0f}s")
        print(f"{'features':<11}{'AUC new':>9}{'AUC old':>9}{'gAUC new':>10}{'gAUC old':>10}")
        for features, m in rows:
            print(f"{features:<11}{m['auc_new']:>9.4f}{m['auc_old']:>9.4f}{m['gauc_new']:>10.4f}{m['gauc_old']:>10.4f}")
        base, best = rows[0][1], rows[-1][1]
        print(f"[ctr] ID + visual IDs vs ID only: new-ad AUC {best['auc_new'] - base['auc_new']:+.4f}, "
              f"old-ad AUC {best['auc_old'] - base['auc_old']:+.4f}")
    finally:
        torch.set_num_threads(threads)
