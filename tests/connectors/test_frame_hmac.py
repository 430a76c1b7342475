"""Issue 10, finding 12: optional keyed integrity of KV frames.

With ``connector_options={"hmac_key_env": "NAME"}`` (shared_storage and redis) every
frame carries an HMAC-SHA256 tag over the whole frame (header and data) and its key; a
reader with the key refuses an unsigned, forged, re-keyed or wrongly signed frame (a
load error, recomputed). Without a key, CRC32 alone: a forged frame with a valid CRC
loads — which is why the key matters.
"""

from __future__ import annotations

import json
import struct
import uuid
import zlib
from pathlib import Path

import pytest
import safetensors.torch
import structlog
import torch
from store_workload import PARAMS, PROMPTS, engine_config

from connectors.framing import decode_block, encode_block, iter_layers
from connectors.shared_storage import SharedStorageOptions
from pipeline import LLM
from pipeline.errors import FrameError, InvalidConfigError

KEY = b"cd" * 4 + b"\x02" * 32
SHAPE = (2, 4, 2, 8)
KEY_ENV = "KVSTEP_TEST_HMAC_KEY"
SECRET = "k3y-" + "9" * 40


def layers(seed: int = 0, n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(n)]


def signer(secret: str = SECRET):  # -> FrameSigner (imported here: new in finding 12)
    from connectors.integrity import FrameSigner
    from connectors.secrets import Secret

    return FrameSigner(Secret(secret))


def decode(data: bytes, key: bytes = KEY, with_signer=None):
    keyed = {} if with_signer is None else {"signer": with_signer}
    return decode_block(data, key, num_layers=3, layer_shape=SHAPE, dtype=torch.float32, **keyed)


def forge_same_crc_layout(data: bytes) -> bytes:
    """Change one data byte and fix that layer's CRC: well-formed, valid CRC, other KV
    (what someone who can write to the store but lacks the key can do)."""
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    body = bytearray(data[8 + size :])
    body[5] ^= 0x40
    begin, end = header["layer.0"]["data_offsets"]
    header["__metadata__"]["crc32.0"] = f"{zlib.crc32(bytes(body[begin:end])) & 0xFFFFFFFF:08x}"
    raw = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(body)


class TestSigner:
    def test_signed_frame_round_trips_and_stays_safetensors(self):
        """Finding 12: a signed frame decodes with the key, is plain safetensors, and
        the signer's repr hides the key."""
        data = encode_block(KEY, layers(), signer=signer())
        got = decode(data, with_signer=signer())
        assert all(torch.equal(a, b) for a, b in zip(got, layers(), strict=True))
        assert set(safetensors.torch.load(data)) == {"layer.0", "layer.1", "layer.2"}
        assert SECRET not in repr(signer()) and SECRET not in str(signer())  # never shown

    @pytest.mark.parametrize(
        "forgery", ["unsigned", "other-key", "bit-flip-with-fixed-crc", "other-block-key"]
    )
    def test_forged_frames_are_refused_with_the_key(self, forgery):
        """Finding 12: unsigned, signed with another key, tampered (CRC fixed up) or
        replayed under another block's key: FrameError with the key."""
        key = KEY
        if forgery == "unsigned":
            data = encode_block(KEY, layers(1))
        elif forgery == "other-key":
            data = encode_block(KEY, layers(1), signer=signer("another key entirely"))
        elif forgery == "bit-flip-with-fixed-crc":
            data = forge_same_crc_layout(encode_block(KEY, layers(), signer=signer()))
        else:
            key = KEY[:-1] + b"\x03"
            data = encode_block(key, layers(), signer=signer())
            data = data.replace(key.hex().encode(), KEY.hex().encode())
            key = KEY
        assert len(decode(data)) == 3  # CRC alone: a well-formed forgery loads
        with pytest.raises(FrameError, match="hmac"):
            decode(data, key, signer())

    def test_signed_frame_under_another_lookup_key_is_refused(self):
        """Finding 12: a validly signed frame looked up under another key never loads."""
        data = encode_block(KEY, layers(), signer=signer())
        with pytest.raises(FrameError):
            decode(data, KEY[:-1] + b"\x07", signer())

    def test_lazy_file_reads_verify_before_the_last_layer(self, tmp_path):
        """Finding 12: from a file, the tag is checked before the last layer is
        yielded, so a reader never sees a complete forged block."""
        path = tmp_path / "v.kv"
        path.write_bytes(forge_same_crc_layout(encode_block(KEY, layers(), signer=signer())))
        it = iter_layers(
            path, KEY, num_layers=3, layer_shape=SHAPE, dtype=torch.float32, signer=signer()
        )
        assert [next(it)[0], next(it)[0]] == [0, 1]
        with pytest.raises(FrameError, match="hmac"):
            next(it)


class TestKeyOption:
    @pytest.mark.parametrize("which", ["shared_storage", "redis"])
    def test_missing_or_empty_variable_is_a_config_error(self, which, monkeypatch, tmp_path):
        """Finding 12: an unset or empty hmac_key_env variable is InvalidConfigError
        naming the option; a set one gives a signer whose value is never shown."""
        pytest.importorskip("redis")
        from connectors.redis_store import RedisOptions

        base = {"path": str(tmp_path)} if which == "shared_storage" else {"url": "redis://h:1/0"}
        cls = SharedStorageOptions if which == "shared_storage" else RedisOptions
        monkeypatch.delenv(KEY_ENV, raising=False)
        with pytest.raises(InvalidConfigError, match="hmac_key_env") as info:
            cls.from_options({**base, "hmac_key_env": KEY_ENV})
        assert KEY_ENV in str(info.value)
        monkeypatch.setenv(KEY_ENV, "")
        with pytest.raises(InvalidConfigError, match="hmac_key_env"):
            cls.from_options({**base, "hmac_key_env": KEY_ENV})
        monkeypatch.setenv(KEY_ENV, SECRET)
        opts = cls.from_options({**base, "hmac_key_env": KEY_ENV})
        assert opts.signer is not None and SECRET not in repr(opts)


# ------------------------------------------------------------------ in engines

BS = 16


def generate(model: Path, connector: str | None, options: dict):
    """(token ids, the rank's stats, captured log events) of a fresh engine."""
    config = engine_config(model, connector, options)
    with structlog.testing.capture_logs() as logs, LLM(config) as llm:
        out = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        stats = llm.engine.core.workers[0].connector.inner.stats if connector else None
    return out, stats, logs


def forged(value: bytes, frame_key: bytes, seed: int) -> bytes:
    """A well-formed frame (valid CRCs, same shape/dtype) with other, loud KV and no tag:
    what a writer without the key produces."""
    tensors = safetensors.torch.load(value)
    gen = torch.Generator().manual_seed(seed)
    fake = [
        torch.randn(tensors[f"layer.{i}"].shape, generator=gen) * 30 for i in range(len(tensors))
    ]
    return encode_block(frame_key, fake)


@pytest.fixture(scope="module")
def reference(llama_path) -> list:
    return generate(llama_path, None, {})[0]


def check_forgery_outcomes(run, reference) -> None:
    """Without the key the forged frames load (outputs change); with it they are load
    errors, recomputed (outputs identical), logged as an HMAC mismatch."""
    out, stats, _ = run(False)
    assert stats.loaded_blocks > 0 and stats.load_errors == 0
    assert out != reference  # the forged KV was used: this is what the key prevents
    out, stats, logs = run(True)
    assert out == reference
    assert stats.load_errors > 0 and stats.loaded_blocks == 0
    assert any("hmac" in str(e).lower() for e in logs if e["log_level"] == "warning")


def test_forged_frames_shared_storage(llama_path, reference, tmp_path, monkeypatch):
    """Finding 12 (shared_storage): forged well-formed frames load without a key and
    are rejected (recomputed, identical outputs) with hmac_key_env."""
    monkeypatch.setenv(KEY_ENV, SECRET)
    store = tmp_path / "store"
    keyed = {"path": str(store), "hmac_key_env": KEY_ENV}
    out, stats, _ = generate(llama_path, "shared_storage", keyed)
    assert out == reference and stats.saved_blocks > 0
    again, stats, _ = generate(llama_path, "shared_storage", keyed)  # signed: loads
    assert again == reference and stats.loaded_blocks > 0 and stats.load_errors == 0
    for n, path in enumerate(sorted(store.glob("*/*/*.kv"))):
        frame_key = path.parts[-3].encode() + bytes.fromhex(path.name.removesuffix(".kv"))
        path.write_bytes(forged(path.read_bytes(), frame_key, n))

    def run(keyed_run: bool):
        options = keyed if keyed_run else {"path": str(store)}
        return generate(llama_path, "shared_storage", options)

    check_forgery_outcomes(run, reference)


def test_forged_frames_redis(llama_path, reference, redis_server, redis_url, monkeypatch):
    """Finding 12 (redis): forged well-formed values load without a key and are
    rejected (recomputed, identical outputs) with hmac_key_env."""
    monkeypatch.setenv(KEY_ENV, SECRET)
    prefix = f"hmac-{uuid.uuid4().hex[:8]}:"
    plain = {"url": redis_url, "key_prefix": prefix}
    keyed = {**plain, "hmac_key_env": KEY_ENV}
    out, stats, _ = generate(llama_path, "redis", keyed)
    assert out == reference and stats.saved_blocks > 0
    with redis_server.client() as client:
        keys = sorted(client.scan_iter(match=f"{prefix}*"))
        assert keys
        for n, key in enumerate(keys):
            fp, block = key.decode().removeprefix(prefix).split(":")
            frame_key = fp.encode() + b":" + bytes.fromhex(block)
            client.set(key, forged(client.get(key), frame_key, n))
    check_forgery_outcomes(
        lambda keyed_run: generate(llama_path, "redis", keyed if keyed_run else plain), reference
    )
