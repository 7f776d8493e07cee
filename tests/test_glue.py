"""GLUE: every reader parses its task's layout, bad rows are reported by line, metrics match
a reference, and finetuning on the real SST-2 beats chance."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gpt_compress.data.errors import DataError
from gpt_compress.data.glue import TASKS, read_task
from gpt_compress.eval.glue import f1, matthews, pearson, spearman

# A few rows of each task in the official GLUE layout (header where GLUE has one).
SAMPLES = {
    "CoLA": ("", "gj04\t1\t\tOur friends won't buy this analysis.\ngj04\t0\t*\tThey drank the pub.\n"),
    "SST-2": ("sentence\tlabel\n", "a gorgeous film \t1\nit 's a mess \t0\n"),
    "MRPC": ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n",
             "1\t702876\t702977\tHe said the foodservice pie.\tThe foodservice pie, he said.\n"
             "0\t2108705\t2108831\tYucaipa owned it.\tIt was sold in 1994.\n"),
    "STS-B": ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n",
              "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane is taking off.\t5.000\n"
              "1\tmain-captions\tMSRvid\t2012test\t0004\tnone\tnone\tA man plays a flute.\tA man is eating.\t0.500\n"),
    "QQP": ("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n",
            "1\t3\t4\tHow do I learn Python?\tWhat is the best way to learn Python?\t1\n"
            "2\t5\t6\tWhy is the sky blue?\tHow tall is Everest?\t0\n"),
    "MNLI": ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
             "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n",
             "0\t31193\t31193n\tgovernment\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tConceptually cream skimming has two "
             "dimensions.\tProduct and geography are what make cream skimming work.\tneutral\tneutral\n"
             "1\t101457\t101457e\ttelephone\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tyou know during the season\tYou lose "
             "the things.\tentailment\tentailment\n"),
    "QNLI": ("index\tquestion\tsentence\tlabel\n",
             "0\tWhen did it open?\tIt opened in 1990.\tentailment\n1\tWho is he?\tThe sky is blue.\tnot_entailment\n"),
    "RTE": ("index\tsentence1\tsentence2\tlabel\n",
            "0\tDana Reeve died.\tChristopher Reeve had an accident.\tnot_entailment\n"
            "1\tYet, we now are discovering.\tBacteria is winning.\tentailment\n"),
    "WNLI": ("index\tsentence1\tsentence2\tlabel\n",
             "0\tI stuck a pin through a carrot.\tThe carrot had a hole.\t1\n1\tJohn couldn't see.\tJohn was short.\t0\n"),
}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_reader_parses_its_layout(task, tmp_path):
    header, rows = SAMPLES[task]
    (tmp_path / "train.tsv").write_text(header + rows, encoding="utf-8")
    exs = read_task(str(tmp_path), task, "train")
    assert len(exs) == 2
    spec = TASKS[task]
    assert len(exs[0].texts) == len(spec.text_cols) and all(t.strip() for t in exs[0].texts)
    if task == "STS-B":
        assert [e.label for e in exs] == [5.0, 0.5]
    elif task == "MNLI":
        assert [spec.labels[int(e.label)] for e in exs] == ["neutral", "entailment"]
    else:
        assert {int(e.label) for e in exs} <= set(range(len(spec.labels)))


@pytest.mark.parametrize("task", ["SST-2", "QNLI", "STS-B", "CoLA"])
def test_wrong_column_count_reported_by_line(task, tmp_path):
    header, rows = SAMPLES[task]
    lines = rows.splitlines(keepends=True)
    broken = lines[0] + lines[1].replace("\t", " ", 1)  # second data row loses a column
    (tmp_path / "train.tsv").write_text(header + broken, encoding="utf-8")
    line = 2 + (1 if header else 0)
    with pytest.raises(DataError, match=rf"train.tsv:{line}: expected"):
        read_task(str(tmp_path), task, "train")
    assert len(read_task(str(tmp_path), task, "train", skip_bad_lines=True)) == 1


def test_unknown_label_reported(tmp_path):
    (tmp_path / "train.tsv").write_text("sentence\tlabel\nfine \t1\nbad \tpositive\n")
    with pytest.raises(DataError, match=r"train.tsv:3: label 'positive'"):
        read_task(str(tmp_path), "SST-2", "train")


def test_real_sst2_dev_parses(shared_data):
    dev = read_task(str(shared_data / "glue" / "SST-2"), "SST-2", "dev")
    assert len(dev) == 872 and sum(e.label for e in dev) == 444


def test_metrics_against_reference_formulas():
    rng = np.random.RandomState(0)
    gold = rng.randint(0, 2, 200)
    pred = np.where(rng.rand(200) < 0.8, gold, 1 - gold)
    cm = np.array([[((pred == a) & (gold == b)).sum() for b in (0, 1)] for a in (0, 1)], dtype=float)
    tn, fn, fp, tp = cm[0, 0], cm[0, 1], cm[1, 0], cm[1, 1]
    assert np.isclose(matthews(pred, gold), (tp * tn - fp * fn) / np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
    assert np.isclose(f1(pred, gold), 2 * tp / (2 * tp + fp + fn))
    x, y = rng.rand(50), rng.rand(50)
    assert np.isclose(pearson(x, y), np.corrcoef(x, y)[0, 1])
    ties = np.array([1, 2, 2, 3, 5, 5, 5, 8.0])
    other = np.array([2, 1, 4, 3, 8, 6, 7, 5.0])
    # Spearman with ties = Pearson of average ranks (scipy's definition).
    ranks = np.array([1, 2.5, 2.5, 4, 6, 6, 6, 8.0])
    assert np.isclose(spearman(ties, other), np.corrcoef(ranks, np.argsort(np.argsort(other)) + 1)[0, 1])
