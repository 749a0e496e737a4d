"""A small, fast GGUF reader: metadata and tensor locations, tensor bytes memory-mapped.

The `gguf` package's reader builds a numpy view per array element, which takes seconds on a
tokenizer's 50k-entry vocabulary; this one parses the header with struct in a single pass.
Dequantization of quantized tensors still goes through `gguf.quants`. Format:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {  # GGUF value type -> struct format
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
# ggml tensor types stored unquantized -> numpy dtype
_PLAIN_TYPES = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}
_BF16 = 30


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the innermost (contiguous) dimension
    ggml_type: int
    offset: int  # from the start of the file


class GGUFFile:
    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        magic, version, num_tensors, num_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF v2+ file")
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self.fields[key] = self._value(value_type)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            shape = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(shape), ggml_type, offset))
        align = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors = [TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos]

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + length
        return self._map[start : self._pos].decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            elem_type, count = self._unpack("<IQ")
            if elem_type in _SCALARS:
                return list(self._unpack(f"<{count}{_SCALARS[elem_type]}"))
            return [self._value(elem_type) for _ in range(count)]
        return self._unpack("<" + _SCALARS[value_type])[0]

    def drop_resident_pages(self) -> None:
        """Unmap the pages read so far from this process (they stay in the page cache, and come
        back on the next read): after a load, a file mapping would otherwise count in the
        process's resident memory for as long as the reader lives."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def tensor_bytes(self, info: TensorInfo, nbytes: int) -> np.ndarray:
        """The first `nbytes` bytes of the tensor's data as stored (a read-only uint8 view)."""
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=info.offset)

    def tensor_array(self, info: TensorInfo) -> np.ndarray:
        """The tensor as float32, numpy (row-major) shape = reversed(info.shape)."""
        shape = tuple(reversed(info.shape))
        count = int(np.prod(shape))
        if info.ggml_type in _PLAIN_TYPES:
            dtype = _PLAIN_TYPES[info.ggml_type]
            data = np.frombuffer(self._map, dtype=dtype, count=count, offset=info.offset)
            return data.reshape(shape).astype(np.float32)
        if info.ggml_type == _BF16:
            raw = np.frombuffer(self._map, dtype=np.uint16, count=count, offset=info.offset)
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        import gguf

        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = shape[-1] // block_size * type_size
        nbytes = count // block_size * type_size
        raw = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=info.offset)
        data = gguf.quants.dequantize(raw.reshape(*shape[:-1], row_bytes), qtype)
        return np.asarray(data, dtype=np.float32).reshape(shape)


@cache
def open_gguf(path: Path) -> GGUFFile:
    """One parsed GGUFFile per path per process (the header is read once)."""
    return GGUFFile(path)
