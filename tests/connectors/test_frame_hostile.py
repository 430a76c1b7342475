"""Issue 10, finding 6 (frame header): a hostile KV frame header — deeply nested JSON,
absurd lengths, wrong types (a bool is not a number), overlapping or duplicate layers —
is a ``FrameError`` (a load error, recomputed), never another exception escaping the
loader, from bytes and from a file alike; in a running engine it is a logged load error
with outputs identical to a run without a connector."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from connectors.framing import decode_block, encode_block, iter_layers
from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.errors import FrameError

KEY = b"ab" * 4 + b"\x01" * 32
SHAPE = (2, 4, 1, 8)  # a 1 in the shape: True == 1 must still be refused
NBYTES = 2 * 4 * 1 * 8 * 4
DATA = bytes(range(256)) * (2 * NBYTES // 256)  # two float32 layers


def _crc(buf: bytes) -> str:
    return f"{zlib.crc32(buf) & 0xFFFFFFFF:08x}"


def valid_header() -> dict[str, Any]:
    """The header ``encode_block`` would write for ``DATA`` (two layers)."""
    meta = {
        "format": "kvstep-kv",
        "version": "1",
        "key": KEY.hex(),
        "num_layers": "2",
        "crc32.0": _crc(DATA[:NBYTES]),
        "crc32.1": _crc(DATA[NBYTES:]),
    }
    layer = {"dtype": "F32", "shape": list(SHAPE)}
    return {
        "__metadata__": meta,
        "layer.0": {**layer, "data_offsets": [0, NBYTES]},
        "layer.1": {**layer, "data_offsets": [NBYTES, 2 * NBYTES]},
    }


def frame(header: dict[str, Any] | bytes, data: bytes = DATA) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def mutate(path: str, value: object) -> bytes:
    """A valid frame with the header field at ``path`` (``a/b/0``) set to ``value``."""
    header = valid_header()
    *parents, last = path.split("/")
    node: Any = header
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return frame(header)


def nested(depth: int) -> bytes:
    return frame(b'{"__metadata__":' + b"[" * depth + b"]" * depth + b"}")


def duplicate_layer() -> bytes:
    """``layer.0`` twice: the second (valid) one would win in a lax parser."""
    text = json.dumps(valid_header())
    bogus = '"layer.0": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}, '
    return frame(text.replace('"layer.0"', bogus + '"layer.0"', 1).encode())


def overlapping() -> bytes:
    """Both layers point at the same bytes (their CRCs agree): a lax reader returns the
    first layer twice."""
    header = valid_header()
    header["layer.1"]["data_offsets"] = [0, NBYTES]
    header["__metadata__"]["crc32.1"] = header["__metadata__"]["crc32.0"]
    return frame(header, DATA[:NBYTES])


def padded(pad: int) -> bytes:
    """A valid header followed by ``pad`` spaces (legal JSON, absurd length)."""
    return frame(json.dumps(valid_header()).encode() + b" " * pad)


HOSTILE = {
    "nested-json": lambda: nested(2000),
    "nested-json-huge": lambda: nested(200_000),
    "padded-1MiB": lambda: padded(1 << 20),
    "bool-in-shape": lambda: mutate("layer.0/shape/2", True),
    "float-in-shape": lambda: mutate("layer.1/shape/0", 2.0),
    "bool-offset": lambda: mutate("layer.0/data_offsets/0", False),
    "float-offset": lambda: mutate("layer.0/data_offsets/1", float(NBYTES)),
    "huge-offsets": lambda: mutate("layer.1/data_offsets", [10**30, 10**30 + NBYTES]),
    "bigint-offset": lambda: mutate("layer.1/data_offsets/1", 10**400),
    "offsets-not-a-list": lambda: mutate("layer.0/data_offsets", {"a": 1}),
    "shape-a-string": lambda: mutate("layer.0/shape", "2,4,1,8"),
    "dtype-a-number": lambda: mutate("layer.0/dtype", 5),
    "info-a-list": lambda: mutate("layer.0", [1, 2, 3]),
    "extra-info-field": lambda: mutate("layer.0/extra", 1),
    "extra-tensor": lambda: mutate(
        "layer.2", {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    ),
    "crc-a-number": lambda: mutate("__metadata__/crc32.0", 12345678),
    "crc-not-hex": lambda: mutate("__metadata__/crc32.0", "zzzzzzzz"),
    "metadata-a-list": lambda: mutate("__metadata__", []),
    "metadata-non-string": lambda: mutate("__metadata__/num_layers", 2),
    "metadata-extra-field": lambda: mutate("__metadata__/note", "x"),
    "duplicate-layer": duplicate_layer,
    "overlapping-layers": overlapping,
    "header-length-2^63": lambda: struct.pack("<Q", 1 << 63) + b"{}" + DATA,
    "header-not-json": lambda: frame(b"\xff\xfe{]" * 10),
    "header-a-list": lambda: frame(b"[1, 2, 3]"),
}


def read(source: bytes | Path) -> list[torch.Tensor]:
    if isinstance(source, bytes):
        return decode_block(source, KEY, num_layers=2, layer_shape=SHAPE, dtype=torch.float32)
    it = iter_layers(source, KEY, num_layers=2, layer_shape=SHAPE, dtype=torch.float32)
    return [t for _, t in it]


def test_the_crafted_valid_frame_decodes(tmp_path):
    """Finding 6 (control): the hand-built frame the hostile cases start from is valid."""
    data = frame(valid_header())
    layers = read(data)
    assert b"".join(t.numpy().tobytes() for t in layers) == DATA
    path = tmp_path / "v.kv"
    path.write_bytes(data)
    assert b"".join(t.numpy().tobytes() for t in read(path)) == DATA  # (NaNs: bytes)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_header_is_a_frame_error(case, tmp_path):
    """Finding 6: each hostile header raises FrameError (short message) from bytes and
    from a file, never RecursionError/TypeError/OverflowError, and never decodes."""
    data = HOSTILE[case]()
    path = tmp_path / "v.kv"
    path.write_bytes(data)
    for source in (data, path):
        with pytest.raises(FrameError) as info:
            read(source)
        assert len(str(info.value)) < 600


BS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * n + 3) % 251 + 1 for n in range(53)], [(5 * n + 1) % 241 + 1 for n in range(40)]]


def config(model: Path, store: Path | None) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        dtype="float32",
        max_model_len=256,
        enable_prefix_caching=False,
        connector="shared_storage" if store is not None else None,
        connector_options={"path": str(store)} if store is not None else {},
    )


def test_hostile_frames_in_a_store_are_recomputed(llama_path, tmp_path):
    """Finding 6: every stored value replaced by one with a hostile header (deep nesting,
    a bool in the shape): each is a logged FrameError load error, outputs identical."""
    with LLM(config(llama_path, None)) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    store = tmp_path / "store"
    with LLM(config(llama_path, store)) as llm:
        llm.generate(PROMPTS, PARAMS)
    values = sorted(store.glob("*/*/*.kv"))
    assert values
    for n, path in enumerate(values):
        if n % 2:
            path.write_bytes(nested(100_000))
            continue
        good = path.read_bytes()
        size = struct.unpack("<Q", good[:8])[0]
        header = json.loads(good[8 : 8 + size])
        header["layer.0"]["shape"] = [True if x == 1 else x for x in header["layer.0"]["shape"]]
        header["layer.0"]["shape"][0] = True  # 2 -> True: a bool, never a number
        path.write_bytes(frame(json.dumps(header).encode(), good[8 + size :]))
    with structlog.testing.capture_logs() as logs, LLM(config(llama_path, store)) as llm:
        out = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        (worker,) = [w.connector.inner for w in llm.engine.core.workers]
        stats = worker.stats
    assert out == reference
    failed = [e for e in logs if e["event"] == "shared_storage: block load failed"]
    assert stats.load_errors > 0 and stats.loaded_blocks == 0
    assert len(failed) == stats.load_errors
    assert all("FrameError" in e["error"] for e in failed)
    assert not [e for e in logs if e["event"] == "shared_storage: loader failed"]


def test_encode_then_decode_still_round_trips():
    """Finding 6 (control): the stricter reader accepts what the writer writes, with
    many layers (layer.10 sorts before layer.2 in the data section)."""
    layers = [torch.full((2, 4, 1, 8), float(i)) for i in range(12)]
    data = encode_block(KEY, layers)
    got = decode_block(data, KEY, num_layers=12, layer_shape=SHAPE, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, layers, strict=True))
