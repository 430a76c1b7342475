"""Parsing and strict validation of a KV frame's header (``connectors.framing``).

The header is untrusted input (anyone who can write to a store writes it), so parsing
never lets an exception other than :class:`FrameError` out: its length is capped from
what the reader expects (a few hundred bytes a layer) before it is read, JSON that is
malformed, deeply nested (``RecursionError``) or has duplicate keys is refused, every
field must have exactly the expected type (a bool is not a number, ``2.0`` is not
``2``), no field may be missing or extra, and the layers must tile the data section
exactly (no gap, overlap or trailing bytes), so the sizes agree with the payload.
Values quoted in errors are shortened (:func:`pipeline.errors.short_repr`).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from connectors.integrity import TAG_FIELD, FrameSigner, TagCheck
from pipeline.errors import FrameError, short_repr

__all__ = ["FORMAT_MAGIC", "FORMAT_VERSION", "ST_DTYPES", "Header", "header_cap", "parse"]

FORMAT_MAGIC = "kvstep-kv"
FORMAT_VERSION = "1"
_MAX_HEADER = 1 << 20  # whatever the layer count, a larger header is not a KV block
_CRC = re.compile(r"[0-9a-f]{8}")
_INFO_KEYS = frozenset({"dtype", "shape", "data_offsets"})

# torch dtype <-> safetensors dtype string, for the dtypes a KV cache uses.
ST_DTYPES: Mapping[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
}


@attrs.frozen
class Header:
    """The parsed, verified header of a value: where each layer's bytes are."""

    data_start: int  # offset of the data section in the whole value
    offsets: tuple[tuple[int, int], ...]  # per layer, relative to data_start
    crcs: tuple[str, ...]
    tag: TagCheck | None  # the running HMAC when the reader has a key


def header_cap(key: bytes, num_layers: int) -> int:
    """The longest header a reader of ``num_layers`` layers accepts (bytes)."""
    return min(_MAX_HEADER, 4096 + 4 * len(key) + 512 * max(num_layers, 0))


def header_len(first8: bytes, total: int, cap: int) -> int:
    """The header length the first 8 bytes announce, checked against ``cap``/``total``.

    Raises:
        FrameError: Too short, or a length past the cap or the value.
    """
    if len(first8) < 8:
        raise FrameError("length", ">= 8", len(first8))
    (n,) = struct.unpack("<Q", first8)
    if n < 2 or n > cap or 8 + n > total:
        raise FrameError("header length", f"2..{min(cap, total - 8)}", short_repr(n))
    return int(n)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k[:40]!r}")
        out[k] = v
    return out


def _load_json(prefix: bytes) -> dict[str, Any]:
    try:
        header = json.loads(prefix, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
        raise FrameError("header", "JSON", short_repr(f"{type(exc).__name__}")) from None
    if not isinstance(header, dict):
        raise FrameError("header", "a JSON object", type(header).__name__)
    return header


def _ints(value: object) -> bool:
    """Whether ``value`` is a list of plain ints (no bools, no floats)."""
    return isinstance(value, list) and all(type(x) is int for x in value)


def _check_meta(meta: object, key: bytes, num_layers: int, signed: bool) -> dict[str, str]:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_MAGIC:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise FrameError("magic", FORMAT_MAGIC, short_repr(got))
    if meta.get("version") != FORMAT_VERSION:
        raise FrameError("version", FORMAT_VERSION, short_repr(meta.get("version")))
    if meta.get("key") != key.hex():
        raise FrameError("key", key.hex(), short_repr(meta.get("key")))
    if meta.get("num_layers") != str(num_layers):
        raise FrameError("num_layers", num_layers, short_repr(meta.get("num_layers")))
    allowed = {"format", "version", "key", "num_layers", TAG_FIELD}
    allowed |= {f"crc32.{i}" for i in range(num_layers)}
    extra = sorted(set(meta) - allowed)
    if extra:
        raise FrameError("metadata", "only the frame's fields", short_repr(extra[0]))
    if not all(isinstance(v, str) for v in meta.values()):
        raise FrameError("metadata", "string values", "another type")
    if signed and not isinstance(meta.get(TAG_FIELD), str):
        raise FrameError(TAG_FIELD, "a tag (this store signs its frames)", None)
    return meta


def parse(
    first8: bytes,
    prefix: bytes,
    total: int,
    key: bytes,
    num_layers: int,
    layer_shape: tuple[int, ...],
    dtype: torch.dtype,
    signer: FrameSigner | None = None,
) -> Header:
    """Verify the header (everything but the checksums and the tag) of a ``total``-byte
    value whose first 8 bytes are ``first8`` and whose header is ``prefix``.

    Raises:
        FrameError: Any mismatch, malformed or hostile header.
    """
    if num_layers < 1:
        raise FrameError("num_layers", ">= 1", num_layers)
    want_dtype = ST_DTYPES.get(dtype)
    if want_dtype is None:
        raise FrameError("dtype", " | ".join(map(str, ST_DTYPES)), dtype)
    header = _load_json(prefix)
    meta = _check_meta(header.get("__metadata__"), key, num_layers, signer is not None)
    names = {"__metadata__", *(f"layer.{i}" for i in range(num_layers))}
    if set(header) != names:
        extra = sorted(set(header) ^ names)
        raise FrameError("tensors", f"layer.0..layer.{num_layers - 1}", short_repr(extra[0]))
    nbytes = int(torch.Size(layer_shape).numel()) * dtype.itemsize
    offsets, crcs = [], []
    for i in range(num_layers):
        info = header[f"layer.{i}"]
        if not isinstance(info, dict) or set(info) != _INFO_KEYS:
            raise FrameError(f"layer.{i}", sorted(_INFO_KEYS), short_repr(info))
        if info["dtype"] != want_dtype:
            raise FrameError(f"layer.{i} dtype", want_dtype, short_repr(info["dtype"]))
        shape = info["shape"]
        if not _ints(shape) or shape != list(layer_shape):
            raise FrameError(f"layer.{i} shape", list(layer_shape), short_repr(shape))
        begin_end = info["data_offsets"]
        if (
            not _ints(begin_end)
            or len(begin_end) != 2
            or begin_end[0] < 0
            or begin_end[1] - begin_end[0] != nbytes
        ):
            raise FrameError(f"layer.{i} offsets", f"{nbytes} bytes", short_repr(begin_end))
        crc = meta.get(f"crc32.{i}")
        if not isinstance(crc, str) or not _CRC.fullmatch(crc):
            raise FrameError(f"crc32.{i}", "8 hex digits", short_repr(crc))
        offsets.append((begin_end[0], begin_end[1]))
        crcs.append(crc)
    end = 0
    for begin, stop in sorted(offsets):  # the layers must tile the data section
        if begin != end:
            raise FrameError("layer offsets", f"contiguous from {end}", begin)
        end = stop
    data_start = 8 + len(prefix)
    if total != data_start + end:
        raise FrameError("length", data_start + end, total)
    tag = signer.check(key, first8, prefix) if signer is not None else None
    if tag is not None and meta.get(TAG_FIELD) != tag.tag:
        raise FrameError(TAG_FIELD, "the tag in the metadata", "another one")
    return Header(data_start, tuple(offsets), tuple(crcs), tag)
