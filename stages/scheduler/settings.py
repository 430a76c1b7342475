"""``SchedulerSettings``: the sizes, seed and policies a
:class:`~stages.scheduler.scheduler.Scheduler` is built from, derived once from
:class:`~pipeline.config.EngineConfig`.

The pool size is not part of it: the engine learns it from the ranks once they have
allocated their caches, and passes it to the scheduler with the connector's scheduler half.
"""

from __future__ import annotations

import attrs

from pipeline.checks import check_int
from pipeline.config import (
    LOAD_FAILURE_POLICIES,
    SCHEDULING_POLICIES,
    EngineConfig,
    config_values,
)
from pipeline.errors import InvalidConfigError

__all__ = ["SchedulerSettings"]

_POSITIVE = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_loras")


@attrs.frozen(kw_only=True)
class SchedulerSettings:
    """How the scheduler batches, caches and stops requests.

    Attributes:
        block_size: Tokens per block.
        max_num_seqs: Most requests running at once.
        max_num_batched_tokens: Tokens computed per step (longer prompts are chunked).
        max_model_len: A request stops with ``"length"`` at this many tokens. It also
            stops when it would need more blocks than the whole pool holds.
        enable_prefix_caching: Reuse cached full blocks across requests.
        hash_seed: Root seed of the chained block hashes.
        load_failure_policy: ``"recompute"`` (truncate to the last valid block and
            recompute) or ``"fail"`` (fail the request) for blocks that fail to load.
        max_loras: Most LoRA adapters among the running requests (a waiting request
            whose adapter would be one more is skipped until one leaves).
        scheduling_policy: ``"fcfs"`` or ``"priority"`` (waiting requests by
            ``(priority, arrival_time)``; lower-priority running requests are preempted
            for a higher one that cannot start).
        tenant_fair_share: A free slot goes to the tenant with the fewest running
            requests (:mod:`stages.scheduler.tenants`).

    Raises:
        InvalidConfigError: A size is not a positive integer, or a policy is unknown.
    """

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    hash_seed: int = 0
    load_failure_policy: str = "recompute"
    max_loras: int = 1
    scheduling_policy: str = "fcfs"
    tenant_fair_share: bool = False

    def __attrs_post_init__(self) -> None:
        for name in _POSITIVE:
            check_int(name, getattr(self, name), InvalidConfigError, lo=1)
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise InvalidConfigError(
                "load_failure_policy",
                self.load_failure_policy,
                f"must be one of {', '.join(LOAD_FAILURE_POLICIES)}",
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidConfigError(
                "scheduling_policy",
                self.scheduling_policy,
                f"must be one of {', '.join(SCHEDULING_POLICIES)}",
            )
        if not isinstance(self.tenant_fair_share, bool):
            raise InvalidConfigError(
                "tenant_fair_share", self.tenant_fair_share, "must be true or false (a bool)"
            )

    @classmethod
    def from_config(cls, config: EngineConfig) -> SchedulerSettings:
        """The scheduler's settings under ``config`` (its fields are ``config``'s of the same
        name)."""
        return cls(**config_values(config, cls))
