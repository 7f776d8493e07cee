"""Read a PyTorch ``pytorch_model.bin`` (zip format) into numpy without executing pickle code.

The pickle stream inside the zip only describes tensors; a restricted unpickler that knows
the handful of globals a state dict uses rebuilds them from the raw storages, and refuses
anything else. torch is not needed.
"""
from __future__ import annotations

from ..errors import CheckpointError, UnsafePickleError  # noqa: F401  (UnsafePickleError re-exported)

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
        self.name, self.dtype = name, _STORAGE_DTYPES[name]


MAX_TENSOR_DIMS = 8


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                        for v in value):
        raise UnsafePickleError(f"tensor {what} {value!r} is not a tuple of integers")
    return tuple(value)


def _rebuild_tensor(storage, offset, size, stride, *_args):
    """A tensor viewing ``storage`` (1-D numpy, as read from the zip) with torch's size/stride in
    elements, copied out. Every element the view can reach must lie inside the storage: a file
    claiming more would otherwise read process memory (or crash)."""
    if not isinstance(storage, np.ndarray) or storage.ndim != 1:
        raise UnsafePickleError("tensor storage is not a storage record of the archive")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise UnsafePickleError(f"tensor storage offset {offset!r} is not a non-negative integer")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride) or len(size) > MAX_TENSOR_DIMS:
        raise UnsafePickleError(f"tensor size {size} and stride {stride} do not describe a tensor")
    if any(d < 0 for d in size) or any(s < 0 for s in stride):
        raise UnsafePickleError(f"tensor size {size} / stride {stride} has negative entries")
    n = storage.shape[0]
    if 0 in size:
        return np.zeros(size, dtype=storage.dtype)
    last = offset + sum((d - 1) * s for d, s in zip(size, stride))  # the farthest element reached
    if last >= n:
        raise UnsafePickleError(f"tensor of size {size} (stride {stride}, offset {offset}) reaches element "
                                f"{last} but its storage holds {n}: the file is corrupt or forged")
    if not size:
        return storage[offset:offset + 1].reshape(()).copy()
    item = storage.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size, strides=tuple(s * item for s in stride))
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
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"unexpected persistent id {pid!r}")
        storage_type, key, numel = pid[1], str(pid[2]), pid[4]
        if not isinstance(storage_type, _StorageType):
            raise UnsafePickleError(f"storage type {storage_type!r} is not a torch storage class")
        if key not in self._cache:
            name = f"{self._prefix}/data/{key}"
            try:
                info = self._zf.getinfo(name)
            except KeyError:
                raise UnsafePickleError(f"storage record {name} is missing from the archive") from None
            dtype = storage_type.dtype
            itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
            if not isinstance(numel, int) or numel < 0 or info.file_size != numel * itemsize:
                raise UnsafePickleError(f"storage record {name} holds {info.file_size} bytes but the pickle "
                                        f"claims {numel!r} x {itemsize}-byte {storage_type.name} elements")
            raw = self._zf.read(name)
            if len(raw) != info.file_size:
                raise UnsafePickleError(f"storage record {name} is truncated")
            if dtype == "bfloat16":  # numpy has no bf16: widen to float32 bit-exactly
                arr = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                arr = np.frombuffer(raw, dtype=dtype)
            self._cache[key] = arr
        return self._cache[key]


def load_torch_bin(path: str) -> dict[str, np.ndarray]:
    """State dict of a zip-format ``.bin``/``.pt`` file as numpy arrays (no code executed)."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is a legacy (non-zip) PyTorch file; re-save it with torch>=1.6 "
                         "or as model.safetensors")
    with zipfile.ZipFile(path) as zf:
        pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise CheckpointError(f"{path}: expected one data.pkl inside the archive, found {len(pkl)}")
        prefix = pkl[0][: -len("/data.pkl")]
        try:
            with zf.open(pkl[0]) as fh:
                obj = _SafeUnpickler(fh, zf, prefix).load()
        except UnsafePickleError as e:
            raise UnsafePickleError(f"{path}: {e}") from None
        except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, ValueError, TypeError, IndexError,
                AttributeError, KeyError, OSError) as e:
            raise CheckpointError(f"{path} is not a readable PyTorch state dict ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} does not hold a state dict")
    return {k: v for k, v in obj.items() if isinstance(v, np.ndarray)}
