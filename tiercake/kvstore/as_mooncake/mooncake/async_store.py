"""``mooncake.async_store``: tiercake's asyncio flavour of Mooncake's store."""

from tiercake.kvstore import MooncakeDistributedStoreAsync

__all__ = ["MooncakeDistributedStoreAsync"]
