"""Keyed integrity of KV frames: HMAC-SHA256 over the whole frame and its key.

CRC32 (in every frame) detects corruption, not an adversary: anyone who can write to a
store can write a well-formed frame with a valid CRC and other KV. With a key
(``connector_options={"hmac_key_env": "NAME"}``, the key read from the environment
variable ``NAME``), every frame carries a tag, the metadata field ``hmac-sha256`` (64 hex
digits), and a reader with the key refuses a frame whose tag is missing or wrong (a load
error, recomputed). Without the key a reader ignores the tag (CRC only).

What the tag covers, in this order (:meth:`FrameSigner.start`, then the layers)::

    b"kvstep-kv-hmac-v1\\0" | len(key) (8 bytes LE) | key | the frame's 8-byte header
    length | the header with the tag's 64 digits replaced by "0" | layer 0's bytes |
    layer 1's bytes | ...

``key`` is the key the value is stored and looked up under (fingerprint key + block
hash), so a valid frame cannot be replayed under another block or model fingerprint.
The reader also checks that the layers tile the data section exactly, so every byte of
the frame is covered. The tag's position is found by its exact byte pattern; a header
holding it more than once is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from connectors.secrets import Secret, secret_from_env
from pipeline.errors import FrameError

__all__ = ["TAG_FIELD", "FrameSigner", "TagCheck", "find_tag", "placeholder_meta"]

TAG_FIELD = "hmac-sha256"
"""The frame metadata field holding the tag (64 lowercase hex digits)."""

_DOMAIN = b"kvstep-kv-hmac-v1\0"
_ZEROS = b"0" * 64
_TAG = re.compile(rb'"' + TAG_FIELD.encode() + rb'"\s*:\s*"([0-9a-f]{64})"')


def placeholder_meta() -> dict[str, str]:
    """The metadata entry a writer puts in before the tag is known."""
    return {TAG_FIELD: _ZEROS.decode()}


def find_tag(header: bytes) -> tuple[str, bytes, int] | None:
    """``(tag, header with the tag zeroed, offset of the tag)``, or ``None`` when the
    header has no tag.

    Raises:
        FrameError: The tag pattern occurs more than once.
    """
    matches = list(_TAG.finditer(header))
    if not matches:
        return None
    if len(matches) > 1:
        raise FrameError(TAG_FIELD, "one tag", f"{len(matches)} tags")
    m = matches[0]
    zeroed = header[: m.start(1)] + _ZEROS + header[m.end(1) :]
    return m.group(1).decode(), zeroed, m.start(1)


class TagCheck:
    """The running HMAC of one frame being read; :meth:`verify` before trusting it."""

    def __init__(self, mac: hmac.HMAC, tag: str) -> None:
        self._mac = mac
        self.tag = tag

    def update(self, data: object) -> None:
        """Feed the next layer's bytes (in layer order)."""
        self._mac.update(data)  # type: ignore[arg-type]

    def verify(self) -> None:
        """Raises:
        FrameError: The tag does not match (a forged, re-keyed or damaged frame)."""
        if not hmac.compare_digest(self._mac.hexdigest(), self.tag):
            raise FrameError(TAG_FIELD, "a tag made with this store's key", "a wrong tag")


class FrameSigner:
    """Signs and checks frames with one key (HMAC-SHA256). Thread-safe (stateless).

    Its repr never shows the key.

    Args:
        key: The secret key (use 32 random bytes or more, e.g. ``openssl rand -hex 32``).
    """

    def __init__(self, key: Secret) -> None:
        self._key = key.reveal().encode()

    @classmethod
    def from_env(cls, option: str, name: object) -> FrameSigner:
        """The signer of the key in environment variable ``name``.

        Raises:
            InvalidConfigError: ``name`` is unset or empty; the message names ``option``
                and the variable, never its value.
        """
        return cls(secret_from_env(option, name))

    def __repr__(self) -> str:
        return "FrameSigner(<hidden>)"

    def start(self, key: bytes, first8: bytes, header: bytes) -> hmac.HMAC:
        """The HMAC of a frame up to its data (``header`` with the tag zeroed)."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(_DOMAIN)
        mac.update(len(key).to_bytes(8, "little"))
        mac.update(key)
        mac.update(first8)
        mac.update(header)
        return mac

    def check(self, key: bytes, first8: bytes, header: bytes) -> TagCheck:
        """A running check of a frame whose raw header is ``header``.

        Raises:
            FrameError: The header has no tag (an unsigned frame), or more than one.
        """
        found = find_tag(header)
        if found is None:
            raise FrameError(TAG_FIELD, "a tag (this store signs its frames)", None)
        tag, zeroed, _ = found
        return TagCheck(self.start(key, first8, zeroed), tag)
