"""The scheduler the ``schedule`` and ``update`` stages drive (:mod:`stages.schedule`,
:mod:`stages.update`): continuous batching over a prefix-cached block pool."""

from pipeline.block_hashes import (
    NONE_HASH,
    BlockHasher,
    ExtraKeys,
    hash_block_tokens,
    hash_fn,
    hash_request_tokens,
    none_hash,
)
from stages.scheduler.apply_output import check_stop
from stages.scheduler.block_pool import BlockPool, KVCacheBlock
from stages.scheduler.kv_manager import ComputedBlocks, KVCacheManager
from stages.scheduler.policy import SchedulingLimits
from stages.scheduler.scheduler import Scheduler
from stages.scheduler.settings import SchedulerSettings

__all__ = [
    "NONE_HASH",
    "BlockHasher",
    "BlockPool",
    "ComputedBlocks",
    "ExtraKeys",
    "KVCacheBlock",
    "KVCacheManager",
    "Scheduler",
    "SchedulerSettings",
    "SchedulingLimits",
    "check_stop",
    "hash_block_tokens",
    "hash_fn",
    "hash_request_tokens",
    "none_hash",
]
