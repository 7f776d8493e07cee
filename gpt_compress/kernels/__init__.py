"""gpt-compress's fused CPU operators (``gptc_ops.cc`` and its headers), built where they run.

The C++ is one translation unit split by concern: ``gptc_ops.cc`` (the formats and the
batch-invariance contract) #includes ``gptc_common.h`` (profiler, thread count, vector helpers),
``gptc_gil.h`` (the ops release the Python GIL while they compute),
``gptc_tiles.h`` (GEMM tiles and blocks, M > 1), ``gptc_gemm512.h`` (the AVX-512 GEMM
micro-kernels), ``gptc_inputs.h`` (per-thread scratch, input quantization), ``gptc_gemv.h`` (M = 1
kernels), ``gptc_linear.h`` (linear_block and the Linear entry points that choose GEMV or blocks),
``gptc_norm_attention.h``,
``gptc_decoder_ops.h`` (the layer machinery: embedding, block, head inputs),
``gptc_decoder_stack.h`` (gptc_generate: the whole decoder in one call),
``gptc_head_score.h`` (gptc_head_score) and ``gptc_tp_ops.h`` (the tensor-parallel rank
programs' ops); ``SOURCES``
lists them all. ``load_ops()`` compiles the unit with ``paddle.utils.cpp_extension.load`` (g++,
``-O3 -fopenmp`` and the instruction set of ``$GPTC_KERNEL_ISA``: ``native``, the default, is
``-march=native``; ``avx2`` is x86-64-v3, AVX2 + FMA + F16C without AVX-512 or VNNI, the build
every x86 host of the last decade runs, so an AVX-512 host can check its wider paths against it)
on first use and caches the library in a directory keyed by the hash of every source file (names
and bytes, in ``SOURCES`` order), the compiler, the flags (the ISA's among them), the Paddle
version and the CPU's instruction-set flags, so a machine with other CPU features (AVX-512 VNNI
vs AVX2 only), another ISA choice or a change to any source builds its own copy and an unchanged
one loads in well under a second. The build compiles a snapshot of all the sources copied into that directory (the
headers are included from beside the snapshot's ``gptc_ops.cc``), never the package's files.
Loading registers the ops with Paddle, so it must happen before a Paddle Inference predictor of
a fused program is created (``inference/fused.py`` does it). A missing compiler or a failed
build raises ``KernelError`` naming what is missing; a library that fails to load (corrupt or
truncated file) is rebuilt once.

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
from typing import Mapping, Optional

import numpy as np

from ..errors import KernelError
from ..fileio import sha256_file as _sha256
from ..runtime import cpu_flags

DIR = os.path.dirname(os.path.abspath(__file__))
# Every file of the one translation unit, the unit first, then its headers in include order
# (tests/test_kernel_sources.py checks this list against the directory and the #include lines).
SOURCES = ("gptc_ops.cc", "gptc_common.h", "gptc_gil.h", "gptc_tiles.h", "gptc_gemm512.h", "gptc_inputs.h", "gptc_gemv.h", "gptc_grouped.h",
           "gptc_linear.h", "gptc_norm_attention.h", "gptc_decoder_ops.h", "gptc_decoder_stack.h", "gptc_head_score.h", "gptc_tp_ops.h",
           "gptc_bench.h")
SOURCE = os.path.join(DIR, SOURCES[0])
NAME = "gptc_ops"
# Bumped when the operators' inputs, attributes or weight formats change (recorded in manifests);
# only this version's programs run (an older export is exported again: inference/fused.py says so).
KERNEL_VERSION = 4  # int8 weights in row groups (3: row-major int8 only; 2: gptc_decoder, 1: per-layer ops)
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-g0"]  # -g0: setuptools adds -g
# $GPTC_KERNEL_ISA -> the instruction-set flags of the build, and the CPU flags the host needs to
# run it. avx2 is x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE): the kernels' AVX2 + FMA
# paths only, whatever the host has beyond them. baseline is x86-64 (SSE2): the scalar paths, what
# a CPU without AVX2 runs, buildable and testable on any x86-64 host.
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3", "-mtune=generic"],
             "baseline": ["-march=x86-64", "-mtune=generic"]}
ISA_NEEDS = {"native": frozenset(), "avx2": frozenset({"avx2", "fma", "f16c", "bmi2"}), "baseline": frozenset()}
# GCC's OpenMP runtime (libgomp), a second one beside the Intel runtime Paddle loads: Paddle's
# set_cpu_math_library_num_threads does not reach it, so the ops take their thread count from
# $GPTC_THREADS (set by inference/fused.py), else OMP_NUM_THREADS. (libiomp5 is not linked instead:
# its threads spin for KMP_BLOCKTIME after every region, which stalls a busy machine.)
LDFLAGS = ["-fopenmp"]
OPS = ("gptc_generate", "gptc_head_score", "gptc_tp_embed", "gptc_tp_attention", "gptc_tp_mlp",
       "gptc_tp_head")  # every operator the library registers

_lock = threading.Lock()
_module = None
build_seconds: Optional[float] = None  # time of this process's build (None: loaded from cache)


def isa() -> str:
    """The instruction set the ops are built for: ``$GPTC_KERNEL_ISA`` (``native``, the default, ``avx2`` or
    ``baseline``)."""
    name = os.environ.get("GPTC_KERNEL_ISA", "").strip() or "native"
    if name not in ISA_FLAGS:
        raise KernelError(f"GPTC_KERNEL_ISA={name!r} is not an instruction set of the fused operators; use "
                          f"{', '.join(ISA_FLAGS)}")
    return name


def isa_problem(name: str) -> Optional[str]:
    """Why this host cannot run the ops built for ISA ``name`` (a CPU flag it lacks), or None."""
    flags = cpu_flags()
    missing = sorted(ISA_NEEDS[name] - flags) if flags else []
    return f"this CPU lacks {', '.join(missing)}, which the {name} build needs" if missing else None


def cflags(name: Optional[str] = None) -> list:
    """The compiler flags of the build for ISA ``name`` (else ``isa()``)."""
    return CFLAGS + ISA_FLAGS[name or isa()]


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


def read_sources(directory: Optional[str] = None) -> dict:
    """``{name: bytes}`` of every file in ``SOURCES``, read from ``directory`` (else ``DIR``, the package's)."""
    out = {}
    for name in SOURCES:
        with open(os.path.join(directory or DIR, name), "rb") as f:
            out[name] = f.read()
    return out


def sources_sha256(sources: Optional[Mapping[str, bytes]] = None) -> str:
    """Hex sha256 of every source file's name and bytes (``sources``, else the package's files)."""
    h = hashlib.sha256()
    sources = read_sources() if sources is None else sources
    for name in SOURCES:  # fixed order; name and length first, so no two file sets hash alike
        data = sources[name]
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def cache_key(sources: Optional[Mapping[str, bytes]] = None) -> str:
    """Hash of the sources (``sources``: ``{name: bytes}`` of every file in ``SOURCES``, else the
    package's files), compiler, flags, Paddle version and CPU flags (the cache subdirectory)."""
    import paddle

    h = hashlib.sha256(sources_sha256(sources).encode())
    for part in (_compiler(), " ".join(cflags() + LDFLAGS), paddle.__version__, " ".join(sorted(cpu_flags())) or platform.machine(), str(KERNEL_VERSION)):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def cache_dir(sources: Optional[Mapping[str, bytes]] = None) -> str:
    """The build directory of this machine's library (of ``sources``, else of the package's files)."""
    root = os.environ.get("GPTC_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gpt-compress",
                                                                "kernels")
    return os.path.join(root, cache_key(sources))


def library_path(sources: Optional[Mapping[str, bytes]] = None) -> str:
    """Path of the built shared library (of ``sources``, else of the package's files; it may not exist yet)."""
    return os.path.join(cache_dir(sources), NAME, NAME + ".so")


@contextlib.contextmanager
def _file_lock(path: str):
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another process building the same library: wait for it
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _snapshot_sources(directory: str, sources: Mapping[str, bytes]) -> str:
    """The unit the library in ``directory`` is built from: a copy of every file in ``SOURCES``,
    made once, inside the keyed directory, so the build compiles exactly the hashed text at one
    fixed path (not whatever the package's files hold mid-edit, nor a rebuild for every
    checkout's different path) and the unit's quoted #includes find the copied headers beside it
    (g++ looks in the including file's directory first): ``sources`` is the text that was
    hashed, read once. Returns the path of the copied ``gptc_ops.cc``."""
    for name in SOURCES:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(sources[name])
            os.replace(tmp, path)
    return os.path.join(directory, SOURCES[0])


@contextlib.contextmanager
def _stderr_into(path: str):
    """File descriptor 2 into ``path`` for the duration: Paddle's ``load`` runs its build in a child
    process (even when the library is current) whose stderr is this process's, so its notices
    (Paddle's import-time OMP_NUM_THREADS advice, setuptools' progress) would reach the user's
    terminal. They are kept for the error message of a failed build; GPTC_VERBOSE=1 shows them."""
    if os.environ.get("GPTC_VERBOSE", "") not in ("", "0"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _build(directory: str, sources: Mapping[str, bytes]):
    from paddle.utils.cpp_extension import load

    log = io.StringIO()
    source = _snapshot_sources(directory, sources)
    errors = os.path.join(directory, "build_stderr.log")
    try:
        with contextlib.redirect_stdout(log), _stderr_into(errors):
            return load(name=NAME, sources=[source], extra_cxx_cflags=cflags(), extra_ldflags=LDFLAGS,
                        build_directory=directory, verbose=False)
    except Exception as e:  # noqa: BLE001  (setuptools/compiler errors of every kind)
        with open(errors, encoding="utf-8", errors="replace") if os.path.exists(errors) else io.StringIO() as f:
            log.write(f.read())
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
    """The op module (every operator of ``OPS``), built or loaded once per process."""
    global _module, build_seconds
    with _lock:
        if _module is not None:
            return _module
        problem = isa_problem(isa())
        if problem:
            raise KernelError(f"GPTC_KERNEL_ISA={isa()}: {problem}; unset it (native)")
        sources = read_sources()  # read once: the key and the snapshot are the same text
        directory = cache_dir(sources)  # names the compiler first: a clear error before Paddle's murky one
        os.makedirs(directory, exist_ok=True)
        so = library_path(sources)
        with _file_lock(directory + ".lock"):
            problem = cached_library_problem(directory)
            if problem:  # rebuild from scratch
                shutil.rmtree(directory, ignore_errors=True)
                os.makedirs(directory, exist_ok=True)
            fresh = not os.path.isfile(so)
            t0 = time.perf_counter()
            try:
                module = _build(directory, sources)
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


CONTROL_DRAFT_VOCAB = 1  # control flags: greedy tokens from the program's draft vocabulary


def control(batch: int, steps: int = 1, eos: Optional[int] = None, pad: int = 0, suppress: int = 0,
            finished=None, draft_vocab: bool = False) -> np.ndarray:
    """gptc_generate's ``control`` input (``gptc_decoder_stack.h``): int64 [steps, eos (-1: none),
    pad, steps whose token is never eos, flags, finished flag per row]; the defaults: one plain
    step. ``draft_vocab``: each step's token is the argmax over the program's draft vocabulary
    (``export/fused.py``), whose head rows alone are computed."""
    done = [0] * batch if finished is None else [int(f) for f in finished]
    flags = CONTROL_DRAFT_VOCAB if draft_vocab else 0
    return np.array([steps, -1 if eos is None else eos, pad, suppress, flags] + done, np.int64)


def kernel_info() -> dict:
    """What a manifest records about the operators an export was written with."""
    return {"version": KERNEL_VERSION, "ops": list(OPS), "source_sha256": sources_sha256()[:16]}


def isa_macros() -> dict:
    """What the compiler defines for the current ISA's flags that decides the ops' vector paths
    (``__AVX2__``, ``__AVX512F__``, ``__AVX512VNNI__``, ``__AVXVNNI__``, ...: name -> bool), read
    from the compiler itself (``-dM -E``), so a test can name the paths a build has."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return {}
    names = ("__AVX2__", "__FMA__", "__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512VNNI__", "__AVXVNNI__")
    try:
        out = subprocess.run([cxx, *ISA_FLAGS[isa()], "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    defined = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
    return {n: n in defined for n in names}
