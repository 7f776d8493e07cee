"""Shared by test_loss.py, test_distill.py and test_parallel.py: gradients computed two ways
(a fused, chunked loss vs its plain full-logits reference; fleet's tensor-parallel pieces vs the
dense model) that differ only in the order of float32 sums."""
from __future__ import annotations

import numpy as np

# Per parameter, relative to that parameter's largest reference gradient entry: the same float32
# math summed in another order (the vocabulary in chunks, rows gathered first, partial sums across
# ranks). A K-term sum reordered moves by at most gamma_K sum |terms| (gamma_K = K u / (1 - K u),
# u = 2^-24), which here comes to some ulps of the parameter's largest entry. Measured (max over
# parameters of max |diff| / max |ref|): lm_loss <= 8.5e-7 (2 x 2 x 2 cases x init and batch
# seeds 0-3), distillation <= 1.1e-6 (18 u; its 4 cases x seeds 0-3), fleet tensor parallel
# <= 7.1e-7 (test_parallel.py, seeds 7, 1-3); absolute <= 1.4e-7 at |grad| <= 0.3. 5e-6 is 4.5x
# the largest. A flat absolute 1e-6 was 1.5e-3 of the smallest parameter's gradients (max |grad|
# 6.5e-4), blind to errors there; a gradient scaled by 1 + 1e-4 fails this by 20x in every
# parameter.
GRAD_RTOL_OF_MAX = 5e-6


def assert_grads_close(grads: dict, ref_grads: dict, rtol_of_max: float = GRAD_RTOL_OF_MAX) -> None:
    """The same parameters get gradients, each within ``rtol_of_max`` x its reference's max |entry|."""
    assert sorted(grads) == sorted(ref_grads)
    for name, ref in ref_grads.items():
        atol = rtol_of_max * float(np.max(np.abs(ref)))
        np.testing.assert_allclose(grads[name], ref, rtol=0, atol=atol, err_msg=name)
