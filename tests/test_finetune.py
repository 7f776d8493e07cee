"""`gptc finetune`: response-only loss, packing, truncation, LoRA, GLUE layouts, resume, and
learning on real data (SST-2 as generation, Tang poems after pretraining on Chinese text)."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import paddle
import pytest

from gpt_compress.checkpoint import build_model, load_model
from gpt_compress.config import ModelConfig
from gpt_compress.data.glue import read_task
from gpt_compress.errors import DataError
from gpt_compress.finetune.config import FinetuneConfig, LoraConfig
from gpt_compress.finetune.data import (Row, collate_packed, collate_padded, encode_rows, pack, plan_batches,
                                        read_rows)
from gpt_compress.finetune.lora import apply_lora, load_adapters, merge_lora, save_adapters
from gpt_compress.finetune.metrics import finetune_loss, score_generations
from gpt_compress.train.loss import lm_head_loss

from _compress_helpers import gptc, teacher_ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SST_PROMPT = "Sentence: {sentence}\nSentiment:"


def _tiny(vocab=1024, seed=0):
    paddle.seed(seed)
    cfg = ModelConfig.from_preset("gpt-tiny", vocab_size=vocab, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = build_model(cfg, "lm")
    model.eval()
    return model


def _sst2_rows(shared_data, split, n=None):
    path = shared_data / "glue" / "SST-2" / f"{split}.tsv"
    ex = read_task(str(path.parent), "SST-2", split)[:n]
    return [Row(SST_PROMPT.format(sentence=e.texts[0].strip()), [" negative", " positive"][int(e.label)], f"{path}:?")
            for e in ex]


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


# ----------------------------------------------------------------------------- 1. loss mask, packing
def test_prompt_tokens_carry_no_gradient(shakespeare, shared_data):
    from gpt_compress.data.tokenizer import Tokenizer

    tok = Tokenizer.load(shakespeare[0])
    examples, _ = encode_rows(tok, _sst2_rows(shared_data, "dev", 6), 64)
    batch = collate_padded(examples, tok.pad_id)
    model = _tiny()
    hidden = model.gpt(paddle.to_tensor(batch["input_ids"]), attention_mask=paddle.to_tensor(batch["attention_mask"]))
    grads = []
    hidden.register_hook(lambda g: grads.append(g.numpy()))  # d loss / d hidden, (B, T, H)
    lm_head_loss(model, hidden, paddle.to_tensor(batch["labels"])).backward()
    per_pos = np.abs(grads[0]).sum(-1)
    for i, ex in enumerate(examples):
        n_prompt = ex.first_target - 1  # positions whose next token is still the prompt
        assert n_prompt > 3
        assert np.all(per_pos[i, :n_prompt] == 0.0), "a prompt position has gradient"
        assert np.all(per_pos[i, n_prompt:ex.positions] > 0), "a response/EOD position has no gradient"
        assert np.all(per_pos[i, ex.positions:] == 0.0)
        # The targets counted are the response tokens and the EOD appended to them.
        labels = batch["labels"][i][batch["labels"][i] != -100].tolist()
        assert labels == ex.tokens[ex.first_target:] and labels[-1] == tok.eod_id


def test_packed_and_unpacked_batches_give_the_same_loss(shakespeare, shared_data):
    from gpt_compress.data.tokenizer import Tokenizer

    tok = Tokenizer.load(shakespeare[0])
    examples, _ = encode_rows(tok, _sst2_rows(shared_data, "dev", 24), 64)
    rows = pack(examples, 128, range(len(examples)))
    assert max(len(r) for r in rows) >= 3  # several examples share each row
    packed = collate_packed(rows, 128, tok.pad_id)
    padded = collate_padded([e for r in rows for e in r], tok.pad_id)
    model = _tiny()
    with paddle.no_grad():
        a, b = float(finetune_loss(model, packed)), float(finetune_loss(model, padded))
        # Without the segment mask the examples would see each other: the test can fail.
        leaky = float(finetune_loss(model, {k: v for k, v in packed.items() if k != "segment_ids"}))
    assert abs(a - b) < 1e-5, (a, b)
    assert abs(leaky - b) > 1e-4  # measured 8e-4 on this random-init model; a - b is ~1e-7


def test_malformed_rows_and_truncation_rule(tmp_path, shakespeare):
    from gpt_compress.data.tokenizer import Tokenizer

    tok = Tokenizer.load(shakespeare[0])
    cfg = FinetuneConfig()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"src": "a", "tgt": "b"}\n\n{"src": "a", "tgt": "b"\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"{re.escape(str(bad))}:3: not valid JSON"):
        read_rows(str(bad), cfg)
    bad.write_text('{"src": "a", "tgt": "b"}\n{"question": "a"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"bad.jsonl:2: no prompt/response .*fields: question"):
        read_rows(str(bad), cfg)
    bad.write_text('{"src_txt": "a", "tgt_txt": ""}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:1: response field 'tgt_txt' is empty"):
        read_rows(str(bad), cfg)
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"src_txt": "q", "tgt_txt": "a"}\n{"src_txt": "only continuation text"}\n', encoding="utf-8")
    rows = read_rows(str(ok), cfg)
    assert (rows[0].prompt, rows[0].response, rows[1].prompt) == ("q", "a", None)
    # Truncation: seq 16 -> 17 tokens. A long prompt is cut at its start; a long response keeps
    # the prompt half the budget and loses its end (and the EOD).
    long_p = Row(" ".join(["word"] * 40), "yes", "x:1")
    long_r = Row("question", " ".join(["word"] * 40), "x:2")
    text = Row(None, " ".join(["word"] * 40), "x:3")
    (e1, e2, *pieces), st = encode_rows(tok, [long_p, long_r, text], 16)
    assert len(e1.tokens) == 17 and e1.tokens[-1] == tok.eod_id and e1.tokens[e1.first_target:-1] == tok.encode("yes")
    assert e2.first_target == len(tok.encode("question")) and len(e2.tokens) == 17 and e2.tokens[-1] != tok.eod_id
    assert (st.truncated_prompts, st.truncated_responses, st.split_texts) == (1, 1, 1)
    # Continuation pieces share one token: every token of [EOD] text [EOD] after the first is a target once.
    joined = [t for p in pieces for t in p.tokens[1:]]
    assert joined == tok.encode(text.response) + [tok.eod_id] and all(len(p.tokens) <= 17 for p in pieces)


# ----------------------------------------------------------------------------- 4. LoRA mechanics
def test_lora_trains_only_adapters_and_merges_exactly(tmp_path, shakespeare, shared_data):
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.train.optim import build_optimizer, build_scheduler
    from gpt_compress.config import OptimizerConfig

    tok = Tokenizer.load(shakespeare[0])
    examples, _ = encode_rows(tok, _sst2_rows(shared_data, "train", 64), 64)
    plan = plan_batches(examples, "pack", 4, 64, tok.pad_id, seed=0)
    model = _tiny()
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    apply_lora(model, LoraConfig(rank=4, targets=["gpt.blocks.*.attn.*", "gpt.blocks.*.mlp.fc_in"],
                                 skip=["gpt.blocks.1.attn.out"]))
    trainable = sorted(n for n, p in model.named_parameters() if not p.stop_gradient)
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert "gpt.blocks.1.attn.out.lora_A" not in trainable and "gpt.blocks.0.attn.out.lora_A" in trainable
    opt_cfg = OptimizerConfig()
    opt_cfg.lr.max_lr, opt_cfg.lr.warmup_rate = 1e-2, 0.0
    sched = build_scheduler(opt_cfg, 10)
    opt = build_optimizer(model, opt_cfg, sched)
    model.train()
    for b in plan.batches[:5]:
        finetune_loss(model, plan.collate(b)).backward()
        opt.step()
        opt.clear_grad()
    model.eval()
    after = model.state_dict()
    for k, v in before.items():  # every base parameter is bit-identical
        assert np.array_equal(after[k].numpy(), v), k
    assert np.abs(after["gpt.blocks.0.attn.qkv.lora_B"].numpy()).max() > 0  # the adapters did train
    ids = paddle.to_tensor(plan.collate(plan.batches[0])["input_ids"])
    with paddle.no_grad():
        unmerged = model(ids).numpy()
    adapter_dir = save_adapters(model, str(tmp_path / "adapter"))
    size = sum(os.path.getsize(os.path.join(adapter_dir, f)) for f in os.listdir(adapter_dir))
    assert size < 0.2 * sum(v.nbytes for v in before.values())  # the adapter file is small
    merge_lora(model)
    assert sorted(model.state_dict()) == sorted(before)  # the base model's names, nothing else
    with paddle.no_grad():
        merged = model(ids).numpy()
    np.testing.assert_allclose(merged, unmerged, atol=1e-5, rtol=0)
    assert np.abs(merged - model_logits_of_base(before, ids)).max() > 1e-3  # merging changed the weights
    # The adapter file alone rebuilds the same model on the base weights.
    base = _tiny()
    base.set_state_dict({k: paddle.to_tensor(v) for k, v in before.items()})
    load_adapters(base, adapter_dir)
    base.eval()
    with paddle.no_grad():
        np.testing.assert_allclose(base(ids).numpy(), unmerged, atol=1e-6, rtol=0)


def model_logits_of_base(state, ids):
    model = _tiny()
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    with paddle.no_grad():
        return model(ids).numpy()


# ----------------------------------------------------------------------------- 5. GLUE layouts
def test_glue_readers_take_the_hugging_face_export(tmp_path, shared_data):
    rte = tmp_path / "RTE"
    rte.mkdir()
    (rte / "train.tsv").write_text("sentence1\tsentence2\tlabel\tidx\n"
                                   "A man is here.\tSomeone is here.\t0\t0\n"
                                   "A man is here.\tNobody is here.\t1\t1\n", encoding="utf-8")
    ex = read_task(str(rte), "RTE", "train")
    assert [e.label for e in ex] == [0.0, 1.0] and ex[1].texts == ("A man is here.", "Nobody is here.")
    # The original RTE layout still reads by position.
    (rte / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tnot_entailment\n", encoding="utf-8")
    assert read_task(str(rte), "RTE", "dev")[0].label == 1.0
    # HF SST-2, as a CSV export of the real dev rows, matches the original file row for row.
    sst = tmp_path / "SST-2"
    sst.mkdir()
    orig = read_task(str(shared_data / "glue" / "SST-2"), "SST-2", "dev")
    import csv
    with open(sst / "dev.tsv", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sentence", "label", "idx"])
        for i, e in enumerate(orig):
            w.writerow([e.texts[0], int(e.label), i])
    hf = read_task(str(sst), "SST-2", "dev")
    assert [(e.texts, e.label) for e in hf] == [(e.texts, e.label) for e in orig] and len(hf) == 872
    # Neither layout: the error names both.
    (rte / "train.tsv").write_text("premise\thyp\tgold\tidx\nA.\tB.\t0\t0\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        read_task(str(rte), "RTE", "train")
    msg = str(e.value)
    assert "train.tsv:2" in msg and "original GLUE" in msg and "Hugging Face glue export" in msg
    assert "sentence1, sentence2, label" in msg


def test_generation_scores_against_reference_values():
    s = score_generations(["the cat sat on the mat", "a b"], ["the cat sat on the mat", "a c"])
    assert s["exact_match"] == 50.0 and 0 < s["bleu"] < 100 and 50 < s["rouge_l"] < 100
    zh = score_generations(["清晨入古寺，初日照高林。"], ["清晨入古寺，初日照高林。"])
    assert zh["bleu"] == pytest.approx(100.0) and zh["rouge_l"] == pytest.approx(100.0)
    half = score_generations(["清晨入古寺"], ["清晨入古寺，初日照高林。"])
    assert 0 < half["rouge_l"] < 100  # CJK text is scored per character, not dropped
