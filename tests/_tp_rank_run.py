"""One rank of tests/test_tp_fused.py, started by ``paddle.distributed.launch``: runs partitioned
exports' fused rank programs (``TensorParallelBackend``) on the inputs of an ``.npz`` (a
left-padded prompt batch and the tokens to feed after it) and writes, on rank 0, for each export
the gathered logits of the prefill and of every decode step, scoring logits, the evaluation
scores of the batch, the greedy and beam tokens of the prompts and the KV cache's dtype
(OUT_i.npz, OUT_i.json).

    python -m paddle.distributed.launch --nproc_per_node 2 tests/_tp_rank_run.py IN.npz OUT DIR [DIR ...]
"""
import json
import sys

import gpt_compress  # noqa: F401  (before paddle: the ops' OpenMP settings)
import numpy as np


def outputs(backend, data, vocab_size: int, max_positions: int) -> dict:
    """What the parity test compares, from ``backend`` (a rank's or the single-card one) on the
    inputs ``data`` (ids, mask, feed)."""
    from gpt_compress.eval.scoring import score_positions
    from gpt_compress.inference.runner import Generator

    ids, mask, feed = data["ids"], data["mask"], data["feed"]
    logits, cache = backend.prefill(ids, mask)
    cache_dtype = str(cache.tensors[0].dtype)  # a FusedCache: the rank's or the single card's
    steps = [logits]
    for j in range(feed.shape[1]):
        mask = np.concatenate([mask, np.ones((len(ids), 1), np.int64)], 1)
        logits, cache = backend.decode(feed[:, j:j + 1], mask, cache)
        steps.append(logits)
    labels = np.concatenate([ids[:, 1:], np.zeros((len(ids), 1), np.int64)], 1)
    select = (data["mask"] == 1) & (np.arange(ids.shape[1]) < ids.shape[1] - 1)
    lp, hit = score_positions(backend, ids, labels, select, data["mask"])
    gen = Generator(backend, vocab_size=vocab_size, max_positions=max_positions, eos_token_id=None, pad_token_id=0)
    prompts = [[int(t) for t, m in zip(r, mr) if m] for r, mr in zip(data["ids"], data["mask"])]
    return {"steps": np.stack(steps), "cache_dtype": cache_dtype, "score": backend.score(ids, data["mask"]), "logprobs": lp, "hits": hit,
            "greedy": gen.generate(prompts, max_new_tokens=16, decode_strategy="greedy").sequences,
            "beam": gen.generate(prompts, max_new_tokens=12, decode_strategy="beam_search", num_beams=3).sequences}


def main(inputs: str, output: str, *model_dirs: str) -> None:
    import paddle.distributed as dist

    from gpt_compress.inference.manifest import read_tp_manifest
    from gpt_compress.inference.tensor_parallel import TensorParallelBackend
    from gpt_compress.parallel.fleet import init_mp

    init_mp(int(read_tp_manifest(model_dirs[0])["mp_degree"]))
    for i, model_dir in enumerate(model_dirs):  # one launch for several partitions of one degree
        top = read_tp_manifest(model_dir)
        backend = TensorParallelBackend(model_dir, rank=dist.get_rank(), fused=True)
        assert backend.fused
        out = outputs(backend, np.load(inputs), top["vocab_size"], top["max_position_embeddings"])
        if dist.get_rank() == 0:
            with open(f"{output}_{i}.json", "w", encoding="utf-8") as f:
                json.dump({k: out.pop(k) for k in ("greedy", "beam", "cache_dtype")}, f)
            np.savez(f"{output}_{i}.npz", **out)
        del backend


if __name__ == "__main__":
    main(*sys.argv[1:])
