"""connectors.framing: one verified safetensors value per KV block."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.framing import FORMAT_MAGIC, decode_block, encode_block, iter_layers
from pipeline.errors import FrameError

KEY = b"fp" + bytes(range(32))
SHAPE = (2, 4, 2, 8)


def layers(n: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen).to(dtype) for _ in range(n)]


def decode(data: bytes, key: bytes = KEY, n: int = 3, dtype=torch.float32, shape=SHAPE):
    return decode_block(data, key, num_layers=n, layer_shape=shape, dtype=dtype)


class TestRoundTrip:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_decode_returns_the_encoded_layers(self, dtype):
        """Every layer comes back bit for bit, in any KV dtype."""
        src = layers(dtype=dtype)
        out = decode(encode_block(KEY, src), dtype=dtype)
        assert all(torch.equal(a, b) and b.dtype == dtype for a, b in zip(src, out, strict=True))

    def test_value_is_plain_safetensors_with_metadata(self):
        """safetensors reads it: tensors layer.{i} and the frame's metadata."""
        data = encode_block(KEY, layers())
        assert sorted(safetensors.torch.load(data)) == ["layer.0", "layer.1", "layer.2"]
        (n,) = struct.unpack("<Q", data[:8])
        header = data[8 : 8 + n].decode()
        assert FORMAT_MAGIC in header and KEY.hex() in header and "crc32.2" in header

    def test_non_contiguous_input(self):
        """A strided view (a block sliced out of a paged cache) is framed correctly."""
        cache = torch.randn(2, 5, 4, 2, 8)
        block = cache[:, 3]
        assert not block.is_contiguous()
        (out,) = decode(encode_block(KEY, [block]), n=1)
        assert torch.equal(out, block)

    def test_iter_layers_from_a_file_is_lazy_and_verified(self, tmp_path):
        """From a path, layers come one by one; a corrupt layer 2 raises after 0 and 1."""
        data = bytearray(encode_block(KEY, layers()))
        path = tmp_path / "v.kv"
        path.write_bytes(data)
        got = [
            i
            for i, _ in iter_layers(path, KEY, num_layers=3, layer_shape=SHAPE, dtype=torch.float32)
        ]
        assert got == [0, 1, 2]
        (n,) = struct.unpack("<Q", data[:8])
        offsets = json.loads(data[8 : 8 + n])["layer.2"]["data_offsets"]
        data[8 + n + offsets[0] + 5] ^= 0x01
        path.write_bytes(data)
        seen = []
        with pytest.raises(FrameError, match="layer 2 checksum"):
            for i, _ in iter_layers(
                path, KEY, num_layers=3, layer_shape=SHAPE, dtype=torch.float32
            ):
                seen.append(i)
        assert seen == [0, 1]


class TestMismatch:
    @pytest.mark.parametrize(
        ("kwargs", "what"),
        [
            ({"key": b"other"}, "key"),
            ({"n": 2}, "num_layers"),
            ({"dtype": torch.float16}, "dtype"),
            ({"shape": (2, 4, 2, 4)}, "shape"),
        ],
    )
    def test_reader_expectation_mismatch(self, kwargs, what):
        """Another key, layer count, dtype or shape raises FrameError naming it."""
        with pytest.raises(FrameError, match=what) as info:
            decode(encode_block(KEY, layers()), **kwargs)
        assert isinstance(info.value, ValueError)

    @pytest.mark.parametrize("cut", [0, 4, 8, 100, -1, -100])
    def test_truncated(self, cut):
        """Any truncation raises FrameError (length or header)."""
        data = encode_block(KEY, layers())
        with pytest.raises(FrameError):
            decode(data[:cut])

    def test_trailing_bytes(self):
        """Extra bytes after the value are a length mismatch."""
        with pytest.raises(FrameError, match="length"):
            decode(encode_block(KEY, layers()) + b"\0")

    def test_not_a_frame(self):
        """A plain safetensors file without the frame's magic is refused."""
        data = safetensors.torch.save({"layer.0": torch.zeros(SHAPE)})
        with pytest.raises(FrameError, match="magic"):
            decode(data, n=1)

    def test_encode_refuses_mixed_layers(self):
        """Layers of different shapes cannot be framed together."""
        with pytest.raises(FrameError):
            encode_block(KEY, [torch.zeros(SHAPE), torch.zeros(2, 2, 2, 8)])
        with pytest.raises(FrameError):
            encode_block(KEY, [])

    @settings(max_examples=200, deadline=None)
    @given(st.data())
    def test_any_bit_flip_is_detected(self, data):
        """A single flipped bit anywhere: FrameError, never different data."""
        src = layers(n=2)
        frame = bytearray(encode_block(KEY, src))
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] ^= 1 << data.draw(st.integers(0, 7))
        try:
            out = decode(bytes(frame), n=2)
        except FrameError:
            return
        assert all(torch.equal(a, b) for a, b in zip(src, out, strict=True))
