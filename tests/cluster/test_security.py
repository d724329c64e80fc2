"""Secure defaults and hostile callers: a conductor never serves its control API open unless told to,
and a client that trickles its body in cannot hold a connection and a buffer for long."""

import asyncio
import json
import os
import subprocess
import sys
import time

import aiohttp
import pytest
from conductor_helpers import running_conductor

from tiercake import errors


def _conductor(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tiercake.cli",
            "conductor",
            "--listen",
            "127.0.0.1:0",
            "--api-listen",
            "127.0.0.1:0",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={k: v for k, v in (env or os.environ).items() if k != "TIERCAKE_TOKEN"},
    )


@pytest.mark.cluster
async def test_a_conductor_without_a_token_refuses_to_start_unless_told_insecure():
    refused = _conductor()
    out, err = refused.communicate(timeout=60)
    assert refused.returncode == 2 and out == b""
    assert "no control token" in err.decode() and "--insecure" in err.decode()

    insecure = _conductor("--insecure")
    try:
        line = insecure.stdout.readline()
        assert line, insecure.stderr.read().decode()[-2000:]
        url = json.loads(line)["url"]
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/v1/members") as resp:  # open, as the operator said
                assert resp.status == 200
    finally:
        insecure.terminate()
        _, err = insecure.communicate(timeout=20)
    assert "INSECURE" in err.decode()  # and said so, loudly


async def test_a_body_that_trickles_in_is_cut_off_with_a_408(monkeypatch):
    """Headers announce a body that never fully arrives (slowloris): the server answers 408 once the
    body deadline passes and closes the connection soon after; it held it 330 s before."""
    monkeypatch.setattr(errors, "BODY_DEADLINE_S", 0.5)
    async with running_conductor(tokens=["t0ken"]) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/placements/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0ken\r\n"
            b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"ten'
        )
        await writer.drain()
        started = time.monotonic()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head, head
        assert time.monotonic() - started < 3
        # then the connection goes, after the server's lingering read (LINGER_S; aiohttp's own is 10 s)
        rest = await asyncio.wait_for(reader.read(), 15)  # read() returns at EOF: the server closed
        assert b"body_timeout" in rest and time.monotonic() - started < errors.LINGER_S + 3
        writer.close()

        # an unauthenticated caller is refused before its body is read at all
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/placements/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 401")
        writer.close()


async def test_metrics_can_be_closed_behind_the_token_too():
    async with running_conductor(tokens=["t0ken"], metrics_open=False) as (url, _):
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/metrics") as resp:
                assert resp.status == 401
            async with http.get(url + "/metrics", headers={"Authorization": "Bearer t0ken"}) as resp:
                assert resp.status == 200 and "tiercake_is_leader" in await resp.text()


async def test_on_one_port_the_openai_paths_take_api_keys_and_the_rest_the_token():
    """serving.port null: both APIs on one port. /v1/models/{id} is the public API's (no control
    token asked, the 503 says no worker yet); the control paths beside it still need the token."""
    from tiercake.conductor.front.frontend import Frontend
    from tiercake.config import default_config

    config = default_config()
    async with running_conductor(tokens=["t0ken"], frontend=lambda c: Frontend(c, config)) as (url, _):
        async with aiohttp.ClientSession() as http:
            for path in ("/v1/models", f"/v1/models/{config.model_id}"):
                async with http.get(url + path) as resp:
                    assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_worker", path
            for path in ("/v1/members", "/v1/cluster", "/v1/modelsx"):
                async with http.get(url + path) as resp:
                    assert resp.status == 401, path


async def test_the_vllm_connectors_link_saves_and_loads_over_a_tls_transfer_port(tmp_path):
    """The connector's link (``ca_file`` + ``transfer_tls``) against a node agent whose transfer port
    speaks TLS only: a save and a load go through; without ``transfer_tls`` the same load fails typed
    (vLLM would recompute), it never reads a plain stream."""
    import ssl

    import torch
    from transfer_helpers import SECRET, start_node, stop_node

    from tiercake.blocks import sealer_for
    from tiercake.conductor.client import Client
    from tiercake.conductor.membership import MemberInfo
    from tiercake.devtls import self_signed
    from tiercake.workers.conductor_link import ConductorLink
    from tiercake.workers.vllm.link import TiercakeLink

    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    store, server = await start_node("node-tls", tls=context)
    async with running_conductor() as (url, _):
        client = Client([url])
        member = MemberInfo(node_id="node-tls", host=server.address[0], port=server.address[1], tiers={"pool": 8 << 20})
        link = await ConductorLink(client, member, store, ttl=2).start()
        tls_link = await asyncio.to_thread(
            TiercakeLink, [url], None, SECRET, "vllm-tls", ("tcp",), ca_file=str(cert), transfer_tls=True
        )
        plain_link = await asyncio.to_thread(TiercakeLink, [url], None, SECRET, "vllm-plain", ("tcp",))
        try:
            block = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
            sealer = sealer_for(b"m" * 32, "")
            saved = await asyncio.wrap_future(
                tls_link.write("node-tls", [(b"key-1", None, block)], "default", sealer, 5)
            )
            assert [r.ok for r in saved] == [True]
            out = torch.empty_like(block)
            (loaded,) = await asyncio.to_thread(tls_link.read, "node-tls", [b"key-1"], [out], 5)
            assert loaded.ok and torch.equal(out, block) and sealer.verify(b"key-1", out.numpy(), loaded.seal)
            (refused,) = await asyncio.to_thread(plain_link.read, "node-tls", [b"key-1"], [out], 1)
            assert not refused.ok and isinstance(refused.error, TimeoutError)
        finally:
            await asyncio.to_thread(tls_link.close)
            await asyncio.to_thread(plain_link.close)
            await link.close()
            await client.close()
    await stop_node(store, server)
    with pytest.raises(ValueError, match="transfer_tls needs ca_file"):
        TiercakeLink(["http://127.0.0.1:1"], None, SECRET, "x", transfer_tls=True)
