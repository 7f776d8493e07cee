"""Training throughput on gpt-bench (batch 8 x seq 256, fp32): full AdamW train steps of ours
against the Hugging Face peer in the same run, with MFU context. A thin entry over
``bench/forward.py`` (which also times forward+backward alone):

    OMP_NUM_THREADS=2 python bench/train.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forward import main  # noqa: E402  (bench scripts are not a package)

if __name__ == "__main__":
    main(["--figures", "train_step_lm_loss,train_step_plain", *sys.argv[1:]])
