"""The scheduler's prefix index, fed by every instance's KV events stream (docs/kv_events.md).

`PrefixIndex.match(hashes)` answers, per LIVE instance, how many leading blocks of a prompt it
holds; `KvIndexManager` keeps the index in step with the registry view and marks instances
whose streams are down or lagging as STALE.
"""

from pdplane.scheduler.kv_index.index import InstanceBlocks, KvState, PrefixIndex
from pdplane.scheduler.kv_index.manager import KvIndexManager, KvInstanceStatus

__all__ = ["InstanceBlocks", "KvIndexManager", "KvInstanceStatus", "KvState", "PrefixIndex"]
