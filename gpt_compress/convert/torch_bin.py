"""Read a PyTorch ``pytorch_model.bin`` (zip format) into numpy without executing pickle code.

The pickle stream inside the zip only describes tensors; a restricted unpickler that knows
the handful of globals a state dict uses rebuilds them from the raw storages, and refuses
anything else. torch is not needed.
"""
from __future__ import annotations

from ..errors import UnsafePickleError  # noqa: F401  (re-exported)

import pickle
import zipfile

import numpy as np

_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": "bfloat16", "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}




class _StorageType:
    def __init__(self, name):
        self.dtype = _STORAGE_DTYPES[name]


def _rebuild_tensor(storage, offset, size, stride, *_args):
    # storage: 1-D numpy array; size/stride in elements (torch semantics).
    if not size:
        return storage[offset:offset + 1].reshape(()).copy()
    item = storage.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * item for s in stride))
    return np.ascontiguousarray(view)


def _rebuild_parameter(data, *_args):
    return data


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, fh, zf: zipfile.ZipFile, prefix: str):
        super().__init__(fh)
        self._zf, self._prefix, self._cache = zf, prefix, {}

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise UnsafePickleError(f"refusing to unpickle {module}.{name}: not part of a plain state dict")

    def persistent_load(self, pid):
        # ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise UnsafePickleError(f"unexpected persistent id {pid!r}")
        storage_type, key = pid[1], str(pid[2])
        if key not in self._cache:
            raw = self._zf.read(f"{self._prefix}/data/{key}")
            dtype = storage_type.dtype
            if dtype == "bfloat16":  # numpy has no bf16: widen to float32 bit-exactly
                arr = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                arr = np.frombuffer(raw, dtype=dtype)
            self._cache[key] = arr
        return self._cache[key]


def load_torch_bin(path: str) -> dict[str, np.ndarray]:
    """State dict of a zip-format ``.bin``/``.pt`` file as numpy arrays (no code executed)."""
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is a legacy (non-zip) PyTorch file; re-save it with torch>=1.6 "
                         "or as model.safetensors")
    with zipfile.ZipFile(path) as zf:
        pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise ValueError(f"{path}: expected one data.pkl inside the archive, found {len(pkl)}")
        prefix = pkl[0][: -len("/data.pkl")]
        with zf.open(pkl[0]) as fh:
            obj = _SafeUnpickler(fh, zf, prefix).load()
    if not isinstance(obj, dict):
        raise ValueError(f"{path} does not hold a state dict")
    return {k: v for k, v in obj.items() if isinstance(v, np.ndarray)}
