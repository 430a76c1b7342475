"""``KVAgent``: one rank's NIXL agent over its paged KV cache.

It registers the rank's cache tensors (one per layer, ``[2, num_blocks, block_size,
kv_heads, head_dim]``, contiguous, on huge pages where the kernel allows:
:mod:`~connectors.nixl.hugepages`) with a NIXL agent on the UCX backend whose progress
thread sleeps between events (:mod:`~connectors.nixl.progress`), describes them
as a :class:`~connectors.nixl.handshake.PeerInfo`, admits peers whose info matches
(model fingerprint, block size, dtype, TP size, layout; else
:class:`PeerMismatchError`), reads remote blocks into local blocks with one READ
descriptor per layer, K/V and run of consecutive blocks, and polls it against a
deadline. ``nixl_cu12`` is imported when an agent is made, so importing this module
needs no NIXL.

Not thread-safe: every call comes from the rank's event loop (or one thread at a time).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from connectors.nixl.errors import PeerMismatchError, TransferError
from connectors.nixl.handshake import PeerInfo
from connectors.nixl.hugepages import back_with_huge_pages
from connectors.nixl.progress import new_agent
from pipeline.errors import InvalidConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["NOTIF_PREFIX", "KVAgent", "ReadHandle", "notification"]

NOTIF_PREFIX = b"kvstep-nixl/2 done "
"""A consumer's notification to the producer: this prefix, then the producer's request
id, a space and the request's ticket (:func:`notification`)."""
_MAX_NOTIF_BYTES = 512


def notification(request_id: str, ticket: str) -> bytes:
    """The notification that tells a producer its request ``request_id`` was read."""
    return NOTIF_PREFIX + f"{request_id} {ticket}".encode()


@attrs.define(eq=False)
class ReadHandle:
    """A READ in flight: its NIXL handle, peer and deadline."""

    engine_id: str
    xfer: Any
    deadline: float
    done: bool = False


@attrs.frozen
class _Peer:
    info: PeerInfo
    agent_name: str


class KVAgent:
    """One rank's NIXL agent (see the module docstring).

    Args:
        engine_id: This engine's id (part of the agent's name).
        fingerprint: The model's rank-independent fingerprint key.
        block_size: Tokens per block.
        tp_rank: This rank.
        tp_size: Number of ranks.
        kv_caches: The rank's cache, one tensor per layer; kept, never resized.
        devices: The network devices UCX may use (``"lo"``: loopback only; ``""``:
            every interface).

    Raises:
        InvalidConfigError: A cache tensor that is not contiguous, or layers that differ
            in shape or dtype.
    """

    def __init__(
        self,
        *,
        engine_id: str,
        fingerprint: str,
        block_size: int,
        tp_rank: int,
        tp_size: int,
        kv_caches: Sequence[torch.Tensor],
        devices: str = "",
    ) -> None:
        _check_layout(kv_caches)
        first = kv_caches[0]
        self.engine_id = engine_id
        self.name = f"{engine_id}/rank{tp_rank}"
        self._caches = list(kv_caches)
        self.huge_page_bytes = back_with_huge_pages(self._caches)  # faster host READs
        self._agent = new_agent(self.name, devices)  # its progress thread sleeps, never spins
        self._reg = self._agent.register_memory(self._caches)
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        self.info = PeerInfo(
            engine_id=engine_id,
            agent_name=self.name,
            agent_metadata=self._agent.get_agent_metadata(),
            fingerprint=fingerprint,
            block_size=block_size,
            dtype=str(first.dtype).removeprefix("torch."),
            tp_rank=tp_rank,
            tp_size=tp_size,
            num_blocks=first.shape[1],
            block_bytes=first[0, 0].numel() * first.element_size(),
            mem_type="DRAM" if first.device.type == "cpu" else "VRAM",
            device_id=max(first.get_device(), 0),
            layer_addrs=tuple(t.data_ptr() for t in self._caches),
        )

    # ------------------------------------------------------------------- peers

    def has_peer(self, engine_id: str) -> bool:
        """Whether ``engine_id`` was admitted (and not removed)."""
        return engine_id in self._peers

    def add_peer(self, info: PeerInfo) -> None:
        """Admit a peer whose KV matches ours; a second call for its engine is a no-op.

        Raises:
            PeerMismatchError: Fingerprint, block size, dtype, TP size/rank, layer
                count, bytes per block or memory type differ.
            TransferError: NIXL refused the peer's metadata.
        """
        if info.engine_id in self._peers:
            return
        mine = self.info
        checks = [  # the fingerprint (dtype, block and TP size in it) last: it says least
            ("block_size", mine.block_size, info.block_size),
            ("dtype", mine.dtype, info.dtype),
            ("tp_size", mine.tp_size, info.tp_size),
            ("tp_rank", mine.tp_rank, info.tp_rank),
            ("num_layers", len(mine.layer_addrs), len(info.layer_addrs)),
            ("block_bytes", mine.block_bytes, info.block_bytes),
            ("fingerprint", mine.fingerprint, info.fingerprint),
        ]
        for field, local, remote in checks:
            if local != remote:
                raise PeerMismatchError(info.engine_id, field, local, remote)
        try:
            name = self._agent.add_remote_agent(info.agent_metadata)
        except Exception as exc:  # nixlBind raises its own types
            raise TransferError(info.engine_id, f"agent metadata refused: {exc!r}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != info.agent_name:
            self._agent.remove_remote_agent(name)
            raise PeerMismatchError(info.engine_id, "agent_name", info.agent_name, name)
        self._peers[info.engine_id] = _Peer(info, name)

    def remove_peer(self, engine_id: str) -> None:
        """Forget a peer (it died or restarted); unknown ids are ignored."""
        peer = self._peers.pop(engine_id, None)
        if peer is not None:
            with contextlib.suppress(Exception):  # already gone
                self._agent.remove_remote_agent(peer.agent_name)

    # ---------------------------------------------------------------- transfers

    def _descs(self, info: PeerInfo, starts: np.ndarray, counts: np.ndarray) -> Any:
        """Nx3 ``(addr, len, dev)`` descriptors: every layer, K then V, every run of
        ``counts[i]`` consecutive blocks from ``starts[i]`` (one descriptor per run)."""
        kv = np.array([0, 1], dtype=np.uint64)
        bases = np.asarray(info.layer_addrs, dtype=np.uint64)
        first = (kv[:, None] * np.uint64(info.num_blocks) + starts[None, :]).reshape(-1)
        addrs = (bases[:, None] + first[None, :] * np.uint64(info.block_bytes)).reshape(-1)
        rows = np.empty((addrs.size, 3), dtype=np.uint64)
        rows[:, 0] = addrs
        rows[:, 1] = np.tile(counts * np.uint64(info.block_bytes), 2 * bases.size)
        rows[:, 2] = info.device_id
        return self._agent.get_xfer_descs(rows.astype(np.int64), info.mem_type)

    def start_read(
        self,
        engine_id: str,
        remote_blocks: Sequence[int],
        local_blocks: Sequence[int],
        notif: bytes,
        timeout_s: float,
    ) -> ReadHandle:
        """Start reading ``remote_blocks`` of peer ``engine_id`` into ``local_blocks``.

        ``notif`` reaches the peer when the read completes. Returns at once.

        Raises:
            TransferError: Unknown peer, block ids out of range or of different counts,
                or NIXL refused the transfer.
        """
        peer = self._peers.get(engine_id)
        if peer is None:
            raise TransferError(engine_id, "peer was never admitted")
        if len(remote_blocks) != len(local_blocks) or not local_blocks:
            raise TransferError(engine_id, "remote and local block counts differ or are 0")
        for blocks, info in ((remote_blocks, peer.info), (local_blocks, self.info)):
            if any(not 0 <= b < info.num_blocks for b in blocks):
                raise TransferError(engine_id, f"block id out of [0, {info.num_blocks})")
        remote_starts, local_starts, counts = _runs(remote_blocks, local_blocks)
        try:
            local = self._descs(self.info, local_starts, counts)
            remote = self._descs(peer.info, remote_starts, counts)
            xfer = self._agent.initialize_xfer("READ", local, remote, peer.agent_name, notif)
            state = self._agent.transfer(xfer)
        except Exception as exc:
            raise TransferError(engine_id, f"NIXL refused the read: {exc!r}") from exc
        handle = ReadHandle(engine_id, xfer, time.monotonic() + timeout_s)
        if state == "ERR":
            self._release(handle)
            raise TransferError(engine_id, "NIXL failed to post the read")
        return handle

    def poll(self, handle: ReadHandle) -> bool:
        """Whether the read completed; releases its handle once done or failed.

        Raises:
            TransferError: The read failed, or is not done by its deadline.
        """
        if handle.done:
            return True
        try:
            state = self._agent.check_xfer_state(handle.xfer)
        except Exception as exc:
            state = f"ERR ({exc!r})"
        if state == "DONE":
            self._release(handle)
            return True
        if state != "PROC":
            self._release(handle)
            raise TransferError(handle.engine_id, f"transfer state {state}")
        if time.monotonic() > handle.deadline:
            self._release(handle)
            raise TransferError(handle.engine_id, "not done by its deadline")
        return False

    def notify(self, engine_id: str, message: bytes) -> None:
        """Send ``message`` to peer ``engine_id`` without a transfer.

        Raises:
            TransferError: Unknown peer, or NIXL refused to send.
        """
        peer = self._peers.get(engine_id)
        if peer is None:
            raise TransferError(engine_id, "peer was never admitted")
        try:
            self._agent.send_notif(peer.agent_name, message)
        except Exception as exc:
            raise TransferError(engine_id, f"NIXL refused the notification: {exc!r}") from exc

    def _release(self, handle: ReadHandle) -> None:
        handle.done = True
        # a transfer still in flight cannot be released: leak it rather than crash
        with contextlib.suppress(Exception):
            handle.xfer.release()

    def take_notifications(self) -> list[tuple[str, str]]:
        """``(request id, ticket)`` of each peer notification since the last call.

        A notification that is too long, lacks :data:`NOTIF_PREFIX` or a ticket, or is
        not UTF-8 is dropped (hostile input).
        """
        out: list[tuple[str, str]] = []
        for messages in self._agent.get_new_notifs().values():
            for msg in messages:
                if len(msg) > _MAX_NOTIF_BYTES or not msg.startswith(NOTIF_PREFIX):
                    continue
                try:
                    req_id, sep, ticket = msg[len(NOTIF_PREFIX) :].decode("utf-8").rpartition(" ")
                except UnicodeDecodeError:
                    continue
                if sep and req_id and ticket:
                    out.append((req_id, ticket))
        return out

    def close(self) -> None:
        """Forget every peer and deregister the cache; idempotent."""
        if self._closed:
            return
        self._closed = True
        for engine_id in list(self._peers):
            self.remove_peer(engine_id)
        try:
            self._agent.deregister_memory(self._reg)
        finally:
            del self._agent


def _runs(remote: Sequence[int], local: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(remote starts, local starts, lengths)`` of the longest runs of blocks that are
    consecutive on both sides: a freshly filled cache hands over long runs, and one
    descriptor per run (not per block) is what lets a READ reach copy speed."""
    r = np.asarray(remote, dtype=np.uint64)
    l_ = np.asarray(local, dtype=np.uint64)
    steps = (np.diff(r.astype(np.int64)) != 1) | (np.diff(l_.astype(np.int64)) != 1)
    breaks = np.flatnonzero(steps) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [r.size]))
    return r[starts], l_[starts], (ends - starts).astype(np.uint64)


def _check_layout(kv_caches: Sequence[torch.Tensor]) -> None:
    if not kv_caches:
        raise InvalidConfigError("nixl kv_caches", kv_caches, "at least one layer")
    first = kv_caches[0]
    for layer, t in enumerate(kv_caches):
        if t.dim() < 3 or t.shape[0] != 2 or not t.is_contiguous():
            raise InvalidConfigError(
                f"nixl kv_caches[{layer}]", tuple(t.shape), "contiguous [2, num_blocks, ...]"
            )
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise InvalidConfigError(
                f"nixl kv_caches[{layer}]", tuple(t.shape), "the shape, dtype, device of layer 0"
            )
