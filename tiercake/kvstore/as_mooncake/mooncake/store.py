"""``mooncake.store``: tiercake's (``tiercake.kvstore``)."""

from tiercake.kvstore import *  # noqa: F403
from tiercake.kvstore import __all__ as _names
from tiercake.kvstore.types import *  # noqa: F403

__all__ = list(_names)
