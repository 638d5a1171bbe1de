"""Reader of CTranslate2's `model.bin` (binary format version 6), into numpy arrays.

The layout is what ctranslate2/specs/model_spec.py `_serialize` writes, all little-endian:

    u32 binary version | string spec name | u32 spec revision | u32 variable count
    per variable: string name | u8 rank | u32 dims[rank] | u8 dtype id | u32 byte count | bytes
    u32 alias count | per alias: string alias | string target name

where a string is a u16 length (including a trailing NUL), the UTF-8 bytes and the NUL.
Aliases name a variable stored once under another name (Whisper's output projection is the
token embedding).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SUPPORTED_BINARY_VERSION = 6
# Type ids in the order of model_spec._dtype_to_type_id.
_DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, None)  # 5 = bfloat16 (unsupported)


class Ct2FormatError(ValueError):
    """The file is not a CTranslate2 model this reader understands."""


@dataclass(frozen=True)
class Ct2Model:
    spec_name: str
    revision: int
    variables: dict[str, np.ndarray]


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.offset = 0

    def unpack(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from(fmt, self.data, self.offset)
        except struct.error as exc:
            raise Ct2FormatError(f"truncated model file at byte {self.offset}") from exc
        self.offset += struct.calcsize(fmt)
        return values

    def u8(self) -> int:
        return self.unpack("<B")[0]

    def u32(self) -> int:
        return self.unpack("<I")[0]

    def string(self) -> str:
        (length,) = self.unpack("<H")
        raw = self.take(length)
        return raw[:-1].decode("utf-8")

    def take(self, count: int) -> bytes:
        if self.offset + count > len(self.data):
            raise Ct2FormatError(f"variable runs past the end of the file at byte {self.offset}")
        chunk = self.data[self.offset : self.offset + count]
        self.offset += count
        return chunk


def read_ct2_model(path: Path) -> Ct2Model:
    cursor = _Cursor(Path(path).read_bytes())
    version = cursor.u32()
    if version != SUPPORTED_BINARY_VERSION:
        raise Ct2FormatError(f"{path}: binary version {version}; this reader reads {SUPPORTED_BINARY_VERSION}")
    spec_name = cursor.string()
    revision = cursor.u32()
    variables: dict[str, np.ndarray] = {}
    for _ in range(cursor.u32()):
        name = cursor.string()
        shape = tuple(cursor.u32() for _ in range(cursor.u8()))
        dtype = _dtype(cursor.u8(), name)
        raw = cursor.take(cursor.u32())
        variables[name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    for _ in range(cursor.u32()):
        alias, target = cursor.string(), cursor.string()
        if target not in variables:
            raise Ct2FormatError(f"alias {alias!r} names a missing variable {target!r}")
        variables[alias] = variables[target]
    return Ct2Model(spec_name, revision, variables)


def _dtype(type_id: int, name: str) -> type:
    if type_id >= len(_DTYPES) or _DTYPES[type_id] is None:
        raise Ct2FormatError(f"variable {name!r} has unsupported type id {type_id}")
    return _DTYPES[type_id]
