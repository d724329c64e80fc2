"""The local processes' ports (conductor/etcd_process.py)."""

import socket

from tiercake.conductor.etcd_process import _ephemeral_low, free_port


def test_a_port_picked_for_a_child_to_listen_on_is_never_one_an_outgoing_connection_could_take():
    """``free_port`` draws below the kernel's ephemeral range (where outgoing connections take their
    source ports: a port picked there was taken before vLLM's worker bound it), free to bind now."""
    low = _ephemeral_low()
    assert low > 11_000  # (Linux's default range starts at 32768)
    for _ in range(50):
        port = free_port()
        assert 10_000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
