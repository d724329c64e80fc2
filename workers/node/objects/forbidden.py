"""What a node answers a request its peer's credential does not reach: a tenant's key asking for
another tenant's objects gets every item refused (FORBIDDEN, Mooncake's ILLEGAL_CLIENT for the
caller), its bytes read and dropped so that the stream stays in step, and the connection served on."""

from __future__ import annotations

import logging

from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import FLAG_NO_REPLY, FLAG_SHM, Forbidden, Op, PeerIdentity, Status
from tiercake.transfer.sockio import receive_or_discard, send_frame

log = logging.getLogger(__name__)

# the request each operation a tenant's key may send carries (its ``tenant`` is checked)
TENANT_REQUESTS = {
    Op.OBJ_PUT: w.PutRequest,
    Op.OBJ_GET: w.GetRequest,
    Op.OBJ_QUERY: w.QueryRequest,
    Op.OBJ_REMOVE: w.RemoveRequest,
}


async def refuse_foreign(conn, op: Op, flags: int, request: int, req, peer: PeerIdentity, epoch: int, deadline) -> None:
    """Refuse every item of ``req`` (for a tenant other than the peer's own) in ``op``'s reply."""
    message = f"{peer}'s key reaches its own objects only, not tenant {req.tenant!r}'s"
    log.warning("refused %s: %s", op.name, message)
    no = w.Result(Status.FORBIDDEN, message)
    if op is Op.OBJ_PUT:
        if flags & FLAG_SHM:
            raise Forbidden(message)
        with deadline(sum(max(0, item.size) for item in req.items)):
            await receive_or_discard(conn, [(None, max(0, item.size)) for item in req.items])
        await send_frame(conn, Op.OBJ_PUT_REPLY, request, w.encode(w.PutReply(epoch, [no] * len(req.items))))
    elif op is Op.OBJ_GET:
        got = w.Got(Status.FORBIDDEN, message=message)
        await send_frame(conn, Op.OBJ_GET_REPLY, request, w.encode(w.GetReply(epoch, [got] * len(req.items))))
    elif op is Op.OBJ_QUERY:
        if not flags & FLAG_NO_REPLY:
            described = w.Described(Status.FORBIDDEN, message=message)
            await send_frame(
                conn, Op.OBJ_QUERY_REPLY, request, w.encode(w.QueryReply(epoch, [described] * len(req.names)))
            )
    elif op is Op.OBJ_REMOVE:
        await send_frame(conn, Op.OBJ_REMOVE_REPLY, request, w.encode(w.RemoveReply(epoch, [no])))
    else:
        raise Forbidden(message)
