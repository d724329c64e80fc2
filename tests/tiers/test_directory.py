"""The same-host object directory (tiers/directory.py): what a reader copies is the current version of
the node it names, or nothing. Real files in /dev/shm, a writer and a reader as node and client hold
them (the reader on a read-only mapping of its own)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from paths import shm_file

from tiercake.tiers.directory import DirectoryReader, ObjectDirectory, ordered_memory

pytestmark = pytest.mark.skipif(not ordered_memory(), reason="the directory is off where memory order needs fences")

OID = bytes(range(32))


@pytest.fixture
def path():
    p = shm_file(f"test-dir-{uuid.uuid4().hex[:12]}")
    yield p
    p.unlink(missing_ok=True)


def pool(fill: int, pool_id: bytes) -> tuple[np.ndarray, bytes]:
    data = np.full(1 << 16, fill, dtype=np.uint8)
    return data, pool_id


def node(path: Path, pool_id: bytes, offset: int = 4096, size: int = 100) -> ObjectDirectory:
    directory = ObjectDirectory(path, 64, pool_id)
    assert directory.publish(OID, offset, size, 1)
    directory.set_valid_until(time.monotonic() + 60)
    return directory


def test_a_reader_copies_the_published_version_and_misses_a_removed_one(path):
    data, pool_id = pool(7, os.urandom(16))
    directory = node(path, pool_id)
    reader = DirectoryReader(path, data, pool_id)
    got = reader.read(OID, None)
    assert isinstance(got, np.ndarray) and got.size == 100 and (got == 7).all()
    directory.unpublish(OID)
    assert reader.read(OID, None) is None
    directory.close(unlink=True)
    reader.close()


def test_a_reader_of_a_replaced_directory_trusts_nothing_in_it(path):
    """The node restarted on a new directory file at the same path (its old one deleted, as a reboot
    deletes it): the old file's lease still runs, but what it lists is the dead node's. A reader holding
    it must ask the node (the new one may have removed what the old file lists)."""
    data, pool_id = pool(7, os.urandom(16))
    old = node(path, pool_id)
    reader = DirectoryReader(path, data, pool_id)
    assert reader.valid() and reader.read(OID, None) is not None
    path.unlink()
    new = ObjectDirectory(path, 64, pool_id)
    new.set_valid_until(time.monotonic() + 60)
    assert not reader.valid()
    assert reader.stale()
    old.close()
    new.close(unlink=True)
    reader.close()


def test_a_directory_of_another_pool_is_not_read_against_the_mapped_one(path):
    """The node restarted on a new pool file but the same directory file: the offsets it publishes are
    in its new pool, not in the one this reader mapped, whose bytes there are another object's (or an
    older version's)."""
    old_data, old_id = pool(7, os.urandom(16))
    node(path, old_id).close()
    reader = DirectoryReader(path, old_data, old_id)
    directory = node(path, os.urandom(16))  # the same file, taken over by a node on a new pool
    assert reader.read(OID, None) is None or not reader.valid()
    assert not reader.valid() and reader.stale()
    directory.close(unlink=True)
    reader.close()


def test_a_lapsed_lease_stops_reads_without_making_the_reader_stale(path):
    data, pool_id = pool(7, os.urandom(16))
    directory = node(path, pool_id)
    reader = DirectoryReader(path, data, pool_id)
    directory.set_valid_until(time.monotonic() - 1)
    assert not reader.valid() and not reader.stale()
    directory.close(unlink=True)
    reader.close()


def test_a_read_is_marked_where_the_node_looks_before_it_removes(path):
    """Mooncake's read lease with no round trip: a copy from the directory leaves its time beside the
    entry, and the node's ``withdraw`` (ahead of a remove) sees it; an object nobody read shows none."""
    data, pool_id = pool(7, os.urandom(16))
    directory = node(path, pool_id)
    other = bytes(reversed(OID))
    assert directory.publish(other, 8192, 10, 1)
    reader = DirectoryReader(path, data, pool_id)
    before = time.monotonic()
    assert reader.read(OID, None) is not None
    assert directory.withdraw(OID) >= before
    assert reader.read(OID, None) is None  # withdrawn: the reader asks the node
    assert directory.withdraw(other) == 0.0
    assert directory.withdraw(b"\0" * 32) == 0.0  # never listed
    assert directory.publish(OID, 4096, 100, 2)  # listed again: a fresh entry, no read of it yet
    assert directory.withdraw(OID) == 0.0
    directory.close(unlink=True)
    reader.close()
