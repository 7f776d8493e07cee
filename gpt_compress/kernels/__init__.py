"""gpt-compress's fused CPU operators (``gptc_ops.cc``): built on the machine that runs them.

``load_ops()`` compiles ``gptc_ops.cc`` with ``paddle.utils.cpp_extension.load`` (g++, ``-O3
-march=native -fopenmp``) on first use and caches the library in a directory keyed by the
source hash, the compiler, the Paddle version and the CPU's instruction-set flags, so a machine
with other CPU features (AVX-512 VNNI vs AVX2 only) or a new source builds its own copy and an
unchanged one loads in well under a second. Loading registers the ops with Paddle, so it must
happen before a Paddle Inference predictor of a fused program is created (``inference/fused.py``
does it). A missing compiler or a failed build raises ``KernelError`` naming what is missing;
a library that fails to load (corrupt or truncated file) is rebuilt once.

Cache directory: ``$GPTC_KERNEL_CACHE`` or ``~/.cache/gpt-compress/kernels``.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from typing import Optional

from ..errors import KernelError
from ..fileio import sha256_file as _sha256
from ..runtime import cpu_flags

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gptc_ops.cc")
NAME = "gptc_ops"
# Bumped when the operators' inputs, attributes or weight formats change (recorded in manifests).
KERNEL_VERSION = 1
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-g0"]  # -g0: setuptools adds -g
# GCC's OpenMP runtime (libgomp), a second one beside the Intel runtime Paddle loads: Paddle's
# set_cpu_math_library_num_threads does not reach it, so the ops take their thread count from
# $GPTC_THREADS (set by inference/fused.py), else OMP_NUM_THREADS. (Linking libiomp5 instead made
# a batch-1 step 4x slower on a busy machine: its threads spin 200 ms after every region.)
LDFLAGS = ["-fopenmp"]
OPS = ("gptc_embed", "gptc_layer", "gptc_head")
SPINCOUNT = "2000"  # libgomp's $GOMP_SPINCOUNT default for the ops (see load_ops)

_lock = threading.Lock()
_module = None
build_seconds: Optional[float] = None  # time of this process's build (None: loaded from cache)


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise KernelError(f"no C++ compiler: {cxx!r} is not on PATH (nor a file). gpt-compress builds its fused CPU "
                          "operators on first use; install g++ (Debian/Ubuntu: apt-get install g++) or set "
                          "$CXX, or run the unfused programs (fused=False, gptc --no-fused)")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelError(f"the C++ compiler {path} does not run: {e}") from None
    return out.splitlines()[0] if out else path


def cache_key(source: Optional[bytes] = None) -> str:
    """Hash of the source (``source``, else the file's bytes), compiler, flags, Paddle version and
    CPU flags (the cache subdirectory)."""
    import paddle

    h = hashlib.sha256(_source_bytes() if source is None else source)
    for part in (_compiler(), " ".join(CFLAGS + LDFLAGS), paddle.__version__, " ".join(sorted(cpu_flags())) or platform.machine(), str(KERNEL_VERSION)):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def _source_bytes() -> bytes:
    with open(SOURCE, "rb") as f:
        return f.read()


def cache_dir(source: Optional[bytes] = None) -> str:
    """The build directory of this machine's library (of ``source``, else of the file's bytes)."""
    root = os.environ.get("GPTC_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gpt-compress",
                                                                "kernels")
    return os.path.join(root, cache_key(source))


def library_path(source: Optional[bytes] = None) -> str:
    """Path of the built shared library (of ``source``, else of the file's bytes; it may not exist yet)."""
    return os.path.join(cache_dir(source), NAME, NAME + ".so")


@contextlib.contextmanager
def _file_lock(path: str):
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another process building the same library: wait for it
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _snapshot_source(directory: str, source: bytes) -> str:
    """The source the library in ``directory`` is built from: a copy made once, inside the keyed
    directory, so the build compiles exactly the hashed text at one fixed path (not whatever
    ``gptc_ops.cc`` holds mid-edit, nor a rebuild for every checkout's different path): ``source``
    is the text that was hashed, read once."""
    path = os.path.join(directory, NAME + ".cc")
    if not os.path.isfile(path):
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(source)
        os.replace(tmp, path)
    return path


def _build(directory: str, source_bytes: bytes):
    from paddle.utils.cpp_extension import load

    log = io.StringIO()
    source = _snapshot_source(directory, source_bytes)
    try:
        with contextlib.redirect_stdout(log):
            return load(name=NAME, sources=[source], extra_cxx_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                        build_directory=directory, verbose=False)
    except Exception as e:  # noqa: BLE001  (setuptools/compiler errors of every kind)
        tail = "\n".join((log.getvalue() + "\n" + str(e)).strip().splitlines()[-15:])
        raise KernelError(f"building gpt-compress's fused CPU operators ({SOURCE}) in {directory} failed: "
                          f"{type(e).__name__}. Compiler output (last lines):\n{tail}\nThe unfused programs "
                          "still run (fused=False)") from None


def cached_library_problem(directory: str) -> Optional[str]:
    """Why the library cached in ``directory`` must not be loaded (corrupt, or a build that never
    finished), or None when it is intact or absent (then it is simply built)."""
    so = os.path.join(directory, NAME, NAME + ".so")
    if not os.path.isfile(so):
        return None
    stamp = os.path.join(directory, "library.sha256")
    if not os.path.isfile(stamp):
        return f"{so} has no library.sha256 stamp (an interrupted build)"
    with open(stamp, encoding="utf-8") as f:
        if f.read().strip() != _sha256(so):
            return f"{so} is corrupt: its sha256 differs from the one stamped when it was built"
    return None


def load_ops():
    """The op module (``gptc_embed``, ``gptc_layer``, ``gptc_head``), built or loaded once per process."""
    global _module, build_seconds
    with _lock:
        if _module is not None:
            return _module
        # libgomp reads this when the library loads: its threads spin this many pause loops
        # (~25 ns each on the AMD EPYC here: ~50 us) at a barrier or between regions, then sleep.
        # Waking a sleeping thread made an empty region cost 13-18 us instead of 3 us (libgomp
        # microbenchmark, load 8), ~32 times per decode step; libgomp's default spin (300,000)
        # made two threads on a loaded 2-core machine 10-30x slower (inference/fused.py
        # DEFAULT_THREADS): a short spin bounds that waste. No effect when another library
        # (torch) loaded libgomp earlier in the process: then only speed differs.
        os.environ.setdefault("GOMP_SPINCOUNT", SPINCOUNT)
        source = _source_bytes()  # read once: the key and the snapshot are the same text
        directory = cache_dir(source)  # names the compiler first: a clear error before Paddle's murky one
        os.makedirs(directory, exist_ok=True)
        so = library_path(source)
        with _file_lock(directory + ".lock"):
            problem = cached_library_problem(directory)
            if problem:  # rebuild from scratch
                shutil.rmtree(directory, ignore_errors=True)
                os.makedirs(directory, exist_ok=True)
            fresh = not os.path.isfile(so)
            t0 = time.perf_counter()
            try:
                module = _build(directory, source)
            except KernelError as e:
                raise KernelError(f"{problem}; rebuilding it failed: {e}" if problem else str(e)) from None
            if fresh:
                build_seconds = time.perf_counter() - t0
            missing = [op for op in OPS if not hasattr(module, op)]
            if missing:
                shutil.rmtree(directory, ignore_errors=True)
                raise KernelError(f"{so} lacks the operator(s) {', '.join(missing)}; removed it, it is rebuilt "
                                  "on next use")
            with open(os.path.join(directory, "library.sha256"), "w", encoding="utf-8") as f:
                f.write(_sha256(so))
        _module = module
        if fresh:
            print(f"gpt-compress: built fused CPU operators in {build_seconds:.1f} s ({so})", file=sys.stderr)
        return _module


def kernel_info() -> dict:
    """What a manifest records about the operators an export was written with."""
    return {"version": KERNEL_VERSION, "ops": list(OPS), "source_sha256": _sha256(SOURCE)[:16]}
