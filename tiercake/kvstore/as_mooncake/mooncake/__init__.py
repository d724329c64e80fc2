"""tiercake's key-value store under Mooncake's package name (see ``tiercake.kvstore.as_mooncake``)."""
