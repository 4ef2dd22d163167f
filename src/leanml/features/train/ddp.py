"""``torchrun`` DDP training that consumes shards of the log stream.

Each rank extracts its own shard (every ``world``-th chunk, see ``LogReader.shard``) with the same
graph and trains a DDP replica; ``Join`` handles ranks whose shards end a few batches early.

    torchrun --nproc_per_node 2 -m leanml.features.train.ddp --graph movielens \\
        --input impressions_train.tsv --out ddp_report

Each rank writes ``rank<r>.json`` (rows, steps, loss, a checksum of its final parameters) into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from leanml.config import Form, option
from leanml.features.options import SMALL_BATCH_ROWS, PipelineOptions, ProducerOptions, TrainOptions
from leanml.features.run.extract import ExtractConfig
from leanml.features.run.producers import Prefetcher
from leanml.features.train.model import model_for_graph
from leanml.features.train.pipeline import train_on
from leanml.flags import add_options, from_args
from leanml.outputs import write_json

# what a rank does differently from `leanml features train`: smaller batches, a producer thread, Adam's usual lr
DEFAULTS = {"batch_rows": SMALL_BATCH_ROWS, "producer": "thread", "lr": 1e-3}


@dataclass(frozen=True)
class DDPJob:
    """One rank's options."""

    input: tuple[str, ...] = option(help="log file (repeatable)", form=Form(repeat=True))
    out: str = option(help="folder of the rank<r>.json reports")
    graph: str = option("movielens", "YAML file or bundled graph name")
    data_dir: str | None = option(None, "where the graph's relative table paths resolve (default: the first "
                                        "log's directory)")
    options: PipelineOptions = option(default_factory=PipelineOptions, form=Form(prefix=""))
    producer: ProducerOptions = option(default_factory=ProducerOptions, form=Form(prefix=""))
    train: TrainOptions = option(default_factory=TrainOptions, form=Form(prefix=""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="DDP training on shards of a FeatureBox log stream (run under torchrun)")
    add_options(p, DDPJob, skip=("plans",), defaults=DEFAULTS)
    job = from_args(DDPJob, p.parse_args(argv))

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    cfg = ExtractConfig.build(job.graph, job.input, job.options, data_dir=job.data_dir, shard=(rank, world))
    torch.manual_seed(job.train.seed)
    # dense embedding gradients: DDP all-reduces them like any other parameter
    model = model_for_graph(cfg.graph, dim=job.train.dim, hidden=job.train.hidden,
                            sparse_grad=False)
    model.to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=job.train.lr)
    t0 = time.perf_counter()
    reps = []
    with Join([ddp]):
        for _ in range(job.train.epochs):
            reps.append(train_on(ddp, Prefetcher(cfg, job.producer), opt, device))  # type: ignore[arg-type]
    wall = time.perf_counter() - t0
    checksum = float(sum(p.detach().double().sum().item() for p in model.parameters()))
    write_json(Path(job.out) / f"rank{rank}.json", {
        "rank": rank, "world": world, "rows": sum(r.rows for r in reps), "steps": sum(r.steps for r in reps),
        "loss": reps[-1].loss, "wall_s": wall, "param_checksum": checksum})
    # free DDP's reducer while the process group lives: freeing it last would destroy the gloo group
    # while holding the GIL that group's worker thread needs, which can deadlock at exit
    del ddp
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
