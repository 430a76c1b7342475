"""The scheduler stage's core: continuous batching over a prefix-cached block pool."""

from stages.schedule.block_pool import BlockPool, KVCacheBlock
from stages.schedule.hashing import (
    NONE_HASH,
    BlockHasher,
    ExtraKeys,
    hash_block_tokens,
    hash_fn,
    hash_request_tokens,
    none_hash,
)
from stages.schedule.kv_manager import ComputedBlocks, KVCacheManager
from stages.schedule.policy import SchedulingLimits
from stages.schedule.scheduler import Scheduler
from stages.schedule.spec import SchedulerSpec
from stages.schedule.update import check_stop

__all__ = [
    "NONE_HASH",
    "BlockHasher",
    "BlockPool",
    "ComputedBlocks",
    "ExtraKeys",
    "KVCacheBlock",
    "KVCacheManager",
    "Scheduler",
    "SchedulerSpec",
    "SchedulingLimits",
    "check_stop",
    "hash_block_tokens",
    "hash_fn",
    "hash_request_tokens",
    "none_hash",
]
