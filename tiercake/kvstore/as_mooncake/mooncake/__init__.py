"""tiercake's key-value store under Mooncake's package name (see ``tiercake.kvstore.as_mooncake``).

``mooncake.store`` and ``mooncake.async_store`` are always tiercake's. Where Mooncake's own wheel is
installed too, its pure-Python helpers that run over the store's API (``mooncake_config``,
``structured_object_store``, ``buffer_pool``) are found in it, after these: this package's search
path ends with the wheel's directory, so they import ``mooncake.store`` and get tiercake's."""

import importlib.metadata as _metadata
from pathlib import Path as _Path


def _wheel_dir() -> str | None:
    for dist in _metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("mooncake-transfer-engine"):
            init = next((f for f in dist.files or [] if str(f).replace("\\", "/") == "mooncake/__init__.py"), None)
            if init is not None:
                return str(_Path(str(dist.locate_file(init))).parent)
    return None


_wheel = _wheel_dir()
if _wheel is not None and _wheel not in __path__:
    __path__.append(_wheel)
