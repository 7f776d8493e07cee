"""One rank of tests/test_parallel.py's check of the fleet tensor-parallel pieces used inside
pipeline stages (pp x mp): the one model with fleet's column/row/vocab-parallel layers, the tied
head and the vocab-parallel loss, on 2 gloo processes. Writes rank 0's loss and whole gradients."""
import sys

import numpy as np
import paddle
import paddle.distributed as dist

from gpt_compress.config import ModelConfig
from gpt_compress.model.gpt import GPTForCausalLM
from gpt_compress.parallel.fleet import init_mp, mp_group, route_mp_collectives_through_gloo, shard_model
from gpt_compress.parallel.pipeline import PipelineLoss, TokenEmbedding, tied_head
from gpt_compress.parallel.plan import tp_split_of

out, ids_path = sys.argv[1], sys.argv[2]
init_mp(2)
route_mp_collectives_through_gloo()
paddle.seed(7)
model = GPTForCausalLM(ModelConfig.from_preset("gpt-tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
rank = dist.get_rank()
model = shard_model(model, rank, 2)
data = np.load(ids_path)
ids, labels = paddle.to_tensor(data[:, :-1]), paddle.to_tensor(data[:, 1:])
logits = tied_head(TokenEmbedding(model.gpt.wte), model.gpt(ids))  # (B, T, V / 2)
loss = PipelineLoss(2)(logits, labels)
loss.backward()
grads = {}
for name, p in model.named_parameters():
    g = p.grad
    split = tp_split_of(name)
    if split is not None:
        parts = []
        dist.all_gather(parts, g, group=mp_group())
        g = paddle.concat(parts, axis=split[1])
    grads[name] = g.numpy()
if rank == 0:
    np.savez(out, loss=float(loss), **grads)
