"""Helper for the nixl tests (not a test file): sign hand-made ``kv_transfer_params``.

A consumer admits ``do_remote_prefill`` params only under a producer's ticket
(:mod:`connectors.nixl.tickets`). Tests that play a producer themselves (a silent one,
one that lies about its model) sign their params as a producer holding the engines'
transfer key would: with this user's default key, which the engines of the test share.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from connectors.nixl.tickets import Ticket, issue_ticket, prompt_digest
from connectors.nixl.transfer_key import TransferKey


def signed(params: dict[str, Any], prompt: Sequence[int], ttl_s: float = 60.0) -> dict[str, Any]:
    """``params`` with a valid ticket for ``prompt`` (and a fresh expiry)."""
    expires_at = round(time.time() + ttl_s, 3)
    ticket = Ticket(
        engine_id=params["remote_engine_id"],
        host=params["remote_host"],
        port=params["remote_port"],
        request_id=params["remote_request_id"],
        block_ids=tuple(params["remote_block_ids"]),
        prompt_digest=prompt_digest(prompt),
        expires_at=expires_at,
    )
    mac = issue_ticket(TransferKey.default(), ticket)
    return {**params, "ticket": mac, "expires_at": expires_at}
