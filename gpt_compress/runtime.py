"""Process-wide CPU settings that decide Paddle's training speed; call ``tune_cpu()`` before the first matmul.

``gptc`` applies them to every command (``GPTC_TUNE_CPU=0`` turns that off); the Paddle Inference
runner applies ``prefer_mkl_avx2`` when it is imported, and the test suite before any test runs
(tests/conftest.py: MKL keeps the kernels of the process's first matmul, so a test's numbers
would otherwise depend on the tests before it). ``import gpt_compress`` applies none of these
(the benchmarks' untuned baselines import it; code that trains through the Python API calls
``tune_cpu()`` first), only ``openmp_spin`` for the fused operators' OpenMP runtime.

Together they make a gpt-bench train step on AMD CPUs about 2.5x faster (``bench/forward.py
--tune ...`` measures each; figures in docs/performance.md). All three leave the math unchanged;
each can be turned off.

* ``mkl_amd``: Paddle 3.3.1 ships an old MKL (``libmklml_intel.so``) that takes a slow generic
  GEMM path on non-Intel CPUs; ``MKL_DEBUG_CPU_TYPE=5`` selects its AVX2 kernels (about 2.5x the
  fp32 GEMM rate). MKL reads the variable at its first BLAS call: setting it after
  ``import paddle`` works, after a matmul it does nothing. Set only on AuthenticAMD (on Intel it
  would trade AVX-512 for AVX2).
* ``strided_views=False``: with ``FLAGS_use_stride_kernel`` on (Paddle's default) slices and
  transposes are strided views, and the kernels that consume them and their gradients fall back
  to slow element-wise copies (the q/k/v slices' backward alone costs a tenth of a step). Off, views
  are materialised by the fast copy kernels. Code that writes in place into a slice to change its
  base tensor would stop doing so; the test suite passes with it off.
* ``math_threads``: the math library's thread count (MKL and the OpenMP of Paddle's CPU kernels),
  fixed once per process at ``$OMP_NUM_THREADS`` (``import gpt_compress`` defaults it to the
  cores). Each Paddle Inference predictor run sets the process's count to its own (a decode
  program: 1) and leaves it there, and a dygraph op sums in another order on another count: a
  model trained after an export's validation run came out different from one trained before it
  (not bitwise; a test fixture's sha256 changed with the tests before it). The inference
  backends put the fixed count back after every run (``restore_math_threads``).
* ``malloc``: glibc serves blocks above its mmap threshold (128 KB to 32 MB) with fresh pages
  whose faults cost more than the op (an out-of-place ``exp`` of 26 MB takes 3x the in-place one).
  ``M_MMAP_MAX=0`` serves every block from the heap and a 1 GB trim threshold keeps freed memory
  for reuse. The price: memory freed by the process is not returned to the OS until it exits,
  and blocks of many sizes fragment the heap. A long-running process whose shapes keep changing
  (``gptc serve``: batches and prompts of every length) grows without bound under it: in-use
  memory stays flat while the heap's free holes cannot serve the next shapes. Such commands
  leave glibc's adaptive policy in place (``cli.SERVICE_COMMANDS``), which maps large blocks
  until a freed one raises its threshold and trims the heap's top.
"""
from __future__ import annotations

import os
import sys

# mallopt parameter numbers from <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 1 << 30


def cpu_vendor() -> str:
    """``vendor_id`` from /proc/cpuinfo (AuthenticAMD, GenuineIntel, ...), or "" if unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset:
    """The ``flags`` of the first CPU in /proc/cpuinfo (avx2, avx512f, ...), empty if unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _glibc_mallopt():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "mallopt", None) if name else None  # None off glibc


def prefer_mkl_avx2() -> str:
    """The ``mkl_amd`` setting alone (no Paddle import): on AMD CPUs select MKL's AVX2 kernels
    unless ``MKL_DEBUG_CPU_TYPE`` is already set. Returns the value in effect. Inference calls it
    too: batch-1 decode on Paddle Inference gains ~10% (gpt-bench, 2 cores)."""
    if cpu_vendor() == "AuthenticAMD":
        os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    return os.environ.get("MKL_DEBUG_CPU_TYPE", "")


# libgomp's $GOMP_SPINCOUNT for the fused ops' OpenMP threads (kernels/): they spin this many
# pause loops (tens of microseconds) at a barrier or between regions, then sleep. Waking a
# sleeping thread costs several times an empty region, and a decode step crosses ~32 barriers;
# libgomp's default (300,000 spins) makes two threads on a busy machine many times slower than
# one, as a spinning thread waits out a descheduled one (inference/fused.py DEFAULT_THREADS).
GOMP_SPINCOUNT = "2000"
_gomp_spin_applies = None


def _libgomp_loaded() -> bool:
    """Whether the system libgomp (soname libgomp.so.1, the one the ops link) is mapped in this
    process. Vendored copies under other names (torch's libgomp-<hash>.so.1) do not count."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return any(os.path.basename(line.rstrip()).startswith("libgomp.so.1") for line in f)
    except OSError:
        return False


def openmp_spin() -> bool:
    """Set ``$GOMP_SPINCOUNT`` (unless the user set it or ``$OMP_WAIT_POLICY``) for libgomp, which
    reads its environment once, when it is loaded; ``import gpt_compress`` calls this. Returns
    whether the setting is in effect: False when libgomp was already loaded without it (``import
    paddle`` loads it: a program that imports paddle before gpt_compress), decided at the first
    call and remembered."""
    global _gomp_spin_applies
    if _gomp_spin_applies is None:
        preset = "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
        _gomp_spin_applies = preset or not _libgomp_loaded()
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    return _gomp_spin_applies


def math_threads() -> int:
    """The process's math-library thread count: ``$OMP_NUM_THREADS`` (as Paddle Inference's
    ``ProgramOptions(threads=0)``), else the number of cores."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else (os.cpu_count() or 1)


_math_threads = None


def restore_math_threads() -> None:
    """Set the math library's thread count back to the process's (``math_threads``, read at the
    first call and kept): a Paddle Inference predictor run sets it to the predictor's own and
    leaves it there. Does nothing before Paddle is imported (it starts at that count)."""
    global _math_threads
    if _math_threads is None:
        _math_threads = math_threads()
    if "paddle" in sys.modules:
        from paddle.base import core

        core.set_num_threads(_math_threads)


def enabled() -> bool:
    """``gptc`` tunes the process unless ``GPTC_TUNE_CPU=0``."""
    return os.environ.get("GPTC_TUNE_CPU", "1") != "0"


def tune_cpu(mkl_amd: bool = True, strided_views: bool = False, malloc: bool = True) -> dict:
    """Apply the settings above; returns what is in effect (for logs and benchmark output)."""
    state = {"cpu_vendor": cpu_vendor()}
    state["MKL_DEBUG_CPU_TYPE"] = prefer_mkl_avx2() if mkl_amd else os.environ.get("MKL_DEBUG_CPU_TYPE", "")

    if "paddle" in sys.modules:
        sys.modules["paddle"].set_flags({"FLAGS_use_stride_kernel": strided_views})
    else:  # Paddle reads FLAGS_* from the environment at import: a command that never uses it never loads it
        os.environ["FLAGS_use_stride_kernel"] = str(int(strided_views))
    state["FLAGS_use_stride_kernel"] = strided_views

    restore_math_threads()
    state["math_threads"] = _math_threads

    state["malloc_heap_only"] = False
    if malloc:
        mallopt = _glibc_mallopt()
        if mallopt and mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD):
            state["malloc_heap_only"] = True
    return state
