"""What `tiercake up` gives back from /dev/shm: what its children left, never what a live process
uses (by inode: a POSIX semaphore is mapped under the name it was made as, then linked to its own;
judged by name, a concurrent vLLM server's semaphore was removed under it and its worker failed)."""

import multiprocessing
import os
from multiprocessing import shared_memory
from pathlib import Path

from tiercake.up_state import ShmLeftovers


def test_leftovers_go_and_what_a_live_process_holds_stays():
    watch = ShmLeftovers()
    lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, mapped by this process
    held = shared_memory.SharedMemory(create=True, size=4096)
    left = shared_memory.SharedMemory(create=True, size=4096)
    left.close()  # unmapped and not removed: what a killed process leaves
    other = Path(f"/dev/shm/not-ours-{os.getpid()}")
    other.write_bytes(b"x")  # not a name multiprocessing or torch gives: never touched
    try:
        removed = watch.clean()
        assert removed == [left.name.lstrip("/")], removed
        assert Path(f"/dev/shm/{held.name.lstrip('/')}").exists() and other.exists()
        assert any(name.startswith("sem.mp-") for name in os.listdir("/dev/shm"))  # the lock's semaphore
        with lock:
            pass
    finally:
        held.close()
        held.unlink()
        other.unlink()
        try:
            left.unlink()
        except FileNotFoundError:
            pass  # the cleaner took it, as it should
