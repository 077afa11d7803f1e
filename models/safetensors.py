"""A small reader/writer for the safetensors format (no pickle, memory-mapped reads).

Format: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the raw little-endian tensor bytes. Truncated or malformed files raise ValueError
naming the file and, where it applies, the tensor.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(bool),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 2**20


class SafetensorsFile:
    """Lazily reads tensors of one .safetensors file: ``names()``, ``shape(name)``, ``get(name)``."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"no safetensors file at {self.path}")
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(
                    f"{self.path}: not a safetensors file (shorter than its 8-byte header length)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise ValueError(f"{self.path}: truncated or not a safetensors file (header length {n})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._start = 8 + n
        data_size = size - self._start
        self._entries = {}
        for name, e in header.items():
            try:
                dtype = _DTYPES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(o) for o in e["data_offsets"])
            except KeyError as err:
                if err.args and err.args[0] == e.get("dtype"):
                    raise ValueError(
                        f"{self.path}: tensor {name!r} has unsupported dtype {e['dtype']!r}"
                    ) from None
                raise ValueError(f"{self.path}: corrupt header entry for tensor {name!r}") from None
            except (TypeError, ValueError):
                raise ValueError(f"{self.path}: corrupt header entry for tensor {name!r}") from None
            if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or begin < 0:
                raise ValueError(f"{self.path}: tensor {name!r} byte range does not match its shape {shape}")
            if end > data_size:
                raise ValueError(
                    f"{self.path}: truncated - tensor {name!r} ends at byte {end} of a {data_size}-byte data section"
                )
            self._entries[name] = (dtype, shape, begin)

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped numpy array."""
        dtype, shape, begin = self._entries[name]
        if int(np.prod(shape, dtype=np.int64)) == 0:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._start + begin, shape=shape)


def save_file(
    tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict[str, str] | None = None
):
    """Writes ``tensors`` (numpy arrays) to ``path`` in the safetensors format."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        if a.dtype not in _NAMES:
            raise TypeError(f"save_file: tensor {name!r} has unsupported dtype {a.dtype}")
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
