"""One rank of tests/test_parallel.py's checkpoint check (started by paddle.distributed.launch):
load a single-process-layout checkpoint into an mp or pp layout and write the logits of a batch."""
import argparse

import numpy as np
import paddle

from gpt_compress.checkpoint import load_model
from gpt_compress.config import Config
from gpt_compress.parallel import build_parallel, init_distributed

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--ids", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--mp", type=int, default=1)
parser.add_argument("--pp", type=int, default=1)
args = parser.parse_args()

cfg = Config()
cfg.parallel.mp_degree, cfg.parallel.pp_degree = args.mp, args.pp
cfg.engine.global_batch_size = cfg.engine.micro_batch_size = 2
dims = init_distributed(cfg)
model = load_model(args.ckpt)  # every rank reads the whole file; the plan keeps its shards
par = build_parallel(dims, cfg)
model = par.apply(model)
model.eval()
ids = np.load(args.ids)
if args.pp > 1:
    logits = par.logits(ids)
else:
    with paddle.no_grad():
        logits = par.gather_numpy(model(par.to_dist(ids)))
if logits is not None and (dims.mp_rank == 0 if args.pp > 1 else dims.is_main):  # one writer
    np.save(args.out, logits)
