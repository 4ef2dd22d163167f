"""``torchrun`` DDP training that consumes shards of the log stream.

Each rank extracts its own shard (every ``world``-th chunk, see ``LogReader.shard``) with the same
graph and trains a DDP replica; ``Join`` handles ranks whose shards end a few batches early.

    torchrun --nproc_per_node 2 -m leanml.features.ddp --graph movielens \\
        --input impressions_train.tsv --out ddp_report

Each rank writes ``rank<r>.json`` (rows, steps, loss, a checksum of its final parameters) into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from leanml.features.graph import FeatureGraph
from leanml.features.model import model_for_graph
from leanml.features.pipeline import ExtractConfig, Prefetcher, train_on
from leanml.utils import write_json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="DDP training on shards of a FeatureBox log stream (run under torchrun)")
    p.add_argument("--graph", default="movielens")
    p.add_argument("--input", action="append", required=True, help="log file (repeatable)")
    p.add_argument("--data-dir")
    p.add_argument("--batch-rows", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--producer", choices=["thread", "process"], default="thread",
                   help="extraction in a thread of each rank, or in DataLoader worker processes")
    p.add_argument("--workers", type=int, default=1, help="producer processes per rank (--producer process)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", default="128,64")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    cfg = ExtractConfig.build(args.graph, args.input, data_dir=args.data_dir, batch_rows=args.batch_rows,
                              shard=(rank, world))
    torch.manual_seed(0)
    hidden = tuple(int(h) for h in args.hidden.split(",") if h)
    # dense embedding gradients: DDP all-reduces them like any other parameter
    model = model_for_graph(FeatureGraph.from_dict(cfg.graph), dim=args.dim, hidden=hidden, sparse_grad=False)
    model.to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    t0 = time.perf_counter()
    reps = []
    with Join([ddp]):
        for _ in range(args.epochs):
            reps.append(train_on(ddp, Prefetcher(cfg, depth=args.prefetch, mode=args.producer,
                                                 workers=args.workers), opt, device))  # type: ignore[arg-type]
    wall = time.perf_counter() - t0
    checksum = float(sum(p.detach().double().sum().item() for p in model.parameters()))
    write_json(Path(args.out) / f"rank{rank}.json", {
        "rank": rank, "world": world, "rows": sum(r.rows for r in reps), "steps": sum(r.steps for r in reps),
        "loss": reps[-1].loss, "wall_s": wall, "param_checksum": checksum})
    # free DDP's reducer while the process group lives: freeing it last would destroy the gloo group
    # while holding the GIL that group's worker thread needs, which can deadlock at exit
    del ddp
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
