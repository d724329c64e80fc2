"""``tiercake chaos``: a cluster under load while its processes die, stall and restart, its SSD blocks
rot and its etcd leader goes; every answer checked against a full recompute.

It starts its own cluster (``tiercake up`` on a three-member etcd when the etcd binary is installed,
else on the embedded backend), replays a synthetic conversation trace against it with greedy decoding
(a few requests in flight at all times), and injects one fault after another:

- ``kill_prefill`` / ``kill_decode`` / ``kill_node`` / ``kill_conductor``: SIGKILL (``up`` restarts it)
- ``stall_node``: the node agent stopped for 20 s (4 with ``--quick``: what a hung disk or machine
  looks like from the others), then resumed; the requests served meanwhile against the rate just
  before (``throughput_during``: workers fence a node out of their path at its first timeout)
- ``partition_node``: the node agent's network cut for a few seconds, then healed: it runs in a
  network namespace of its own behind a veth pair (``tiercake.netns``; needs root, else the fault is
  left out and the run says so) and the link goes down: its connections black-hole, it leaves the
  members, and once healed it registers again
- ``corrupt_ssd``: bytes flipped inside block files of the node's SSD tier, after the caches above it
  were flushed so that the next requests read them
- ``kill_etcd_leader``: SIGKILL of the etcd member that leads, restarted a few seconds later
- ``rolling_restart``: every process in turn stopped as a rolling update stops it (SIGTERM) and
  started again by ``up``, the next once the one before serves (``hit_ratio_during`` beside the
  ratio just before)
- ``upgrade``: a node agent of the previous release (``--previous DIR``; else the fault is left out
  and the run says so) joins beside the current one, serves blocks over the previous protocol, and is
  upgraded in place (``chaos/upgrade.py``)

- the store's own (``chaos/store_faults.py``): ``forge_replication`` (a client's credential naming a
  slot's primary: refused), ``regex_stall`` (a pattern that backtracks exponentially in Python's re),
  ``big_batch`` (16,000 persisted objects in one call), ``kill_node_without_pool`` (a host reboot: the
  pool file deleted with the node agent SIGKILLed)

Beside the requests, a key-value workload (``chaos/kv.py``: clients of the cluster's store
putting, upserting, removing and reading checksummed values) runs throughout; after each fault every
key is read back, and at the end each key's history is checked for linearizability: an acknowledged
object gone (``kv.lost``), a read not whole (``kv.torn``) or a history no order explains
(``kv.violations``) fails the run. Requests are retried as OpenAI's client retries them (``RETRIES``
on 408, 429, 5xx and lost connections, backing off): ``failed`` counts those that failed after that.

Every answer is compared with the same prompt computed here from scratch by the reference model (no
cache anywhere): a different answer is ``wrong``. After the faults, every placement the index still
lists is read back from its node: one that cannot be served, other than a corrupted block the read
detects (the node's checksum counter says so), is an acknowledged placement ``lost``.
Recovery is the time from a fault to the first request served after it with every member back,
beside the time the whole cluster took to start in the same run. The run fails (exit 1) if any
answer is wrong or any placement lost.
"""

from .faults import pid_listening
from .load import Oracle
from .run import FAULTS, failed, run

__all__ = ["FAULTS", "Oracle", "failed", "pid_listening", "run"]
