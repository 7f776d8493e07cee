"""One rank of tests/test_tp_fused.py, started by ``paddle.distributed.launch``: runs a partitioned
export's rank programs (``TensorParallelBackend``, fused or not as asked) on the inputs of an
``.npz`` (a left-padded prompt batch and the tokens to feed after it) and writes, on rank 0, the
gathered logits of the prefill and of every decode step, scoring logits, the greedy and beam
tokens of the prompts and the evaluation scores of the batch.

    python -m paddle.distributed.launch --nproc_per_node 2 tests/_tp_rank_run.py MODEL_DIR IN.npz OUT.npz fused
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
    return {"steps": np.stack(steps), "score": backend.score(ids, data["mask"]), "logprobs": lp, "hits": hit,
            "greedy": gen.generate(prompts, max_new_tokens=16, decode_strategy="greedy").sequences,
            "beam": gen.generate(prompts, max_new_tokens=12, decode_strategy="beam_search", num_beams=3).sequences}


def main(model_dir: str, inputs: str, output: str, mode: str) -> None:
    import paddle.distributed as dist

    from gpt_compress.inference.manifest import read_tp_manifest
    from gpt_compress.inference.tensor_parallel import TensorParallelBackend
    from gpt_compress.parallel.fleet import init_mp

    top = read_tp_manifest(model_dir)
    init_mp(int(top["mp_degree"]))
    backend = TensorParallelBackend(model_dir, rank=dist.get_rank(), fused=mode == "fused")
    assert backend.fused == (mode == "fused")
    out = outputs(backend, np.load(inputs), top["vocab_size"], top["max_position_embeddings"])
    if dist.get_rank() == 0:
        with open(output + ".json", "w", encoding="utf-8") as f:
            json.dump({"greedy": out.pop("greedy"), "beam": out.pop("beam")}, f)
        np.savez(output, **out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
