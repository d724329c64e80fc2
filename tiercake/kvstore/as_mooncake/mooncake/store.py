"""``mooncake.store``: tiercake's (``tiercake.kvstore``), in the shape of Mooncake's module: its
classes, its host-memory allocator, and its enums' members at the top level as well (Mooncake's
binding exports them so)."""

from tiercake.kvstore import *  # noqa: F403
from tiercake.kvstore import __all__ as _names
from tiercake.kvstore.host_memory import MooncakeHostMemAllocator, bind_to_numa_node
from tiercake.kvstore.types import *  # noqa: F403
from tiercake.kvstore.types import ObjectDataType, ReplicaStatus, TaskStatus, TaskType

_members = {member.name: member for enum in (ObjectDataType, ReplicaStatus, TaskType, TaskStatus) for member in enum}
globals().update(_members)

__all__ = [*_names, "MooncakeHostMemAllocator", "bind_to_numa_node", *_members]
