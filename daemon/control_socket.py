"""The control socket: the daemon's ZeroMQ ROUTER, what one peer may cost it, and what
libzmq says of a received message's connection (its credentials, its descriptor)."""

from __future__ import annotations

import zmq

from sparsekv.proto import LIMITS

# What one peer may cost the ROUTER (libzmq enforces these in its I/O thread):
# - the largest frame of a legal request; a peer announcing a larger one is disconnected
#   before the frame is read (ZMQ_MAXMSGSIZE applies to each frame of a multipart);
MAX_MESSAGE_BYTES = max(LIMITS.max_frame_bytes, LIMITS.max_header_bytes)
# - a PING every HEARTBEAT_IVL_MS; a connection silent for HEARTBEAT_TIMEOUT_MS (a frozen
#   or vanished peer: nothing answers the PINGs) is closed;
HEARTBEAT_IVL_MS = 5_000
HEARTBEAT_TIMEOUT_MS = 30_000
# - a connection that has not finished the ZMTP handshake within this is closed (a raw
#   socket that connects and says nothing holds a descriptor only this long).
HANDSHAKE_IVL_MS = 5_000
LISTEN_BACKLOG = 32
# - libzmq reads a large frame in one read() while its sender keeps up, and every
#   connection served by the same I/O thread waits meanwhile: with several threads, one
#   client's large WRITE stalls only those that share its thread (tests/soak/stall.py).
ZMQ_IO_THREADS = 4


def router(ctx: zmq.Context) -> zmq.Socket:
    """The control socket (not yet bound), with every limit on what a peer may cost."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    # No handover: a connection under a routing id that a live connection holds is never
    # read (libzmq leaves its pipe anonymous; the HELLO deadline closes it), so no peer can
    # take a session's pipe. With handover on, another process under a client's id took
    # its pipe (the client hung) and libzmq 4.3.5 aborted when the client closed
    # (`!_io_error`, stream_engine_base.cpp:310). tests/daemon/test_routing_ids.py guards
    # both. A client's reconnect under its own id works once the daemon has seen its old
    # connection close; Client.connect() takes a fresh random id each time.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    # Queued connections are still accepted after the connection guard renames control.sock away.
    sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
    # A ZAP domain (no handler bound: NULL-mechanism peers pass) makes libzmq refuse
    # ZMTP/1.0 and 2.0 peers: libzmq 4.3.5 leaks memory for every ZMTP/1.0 connection
    # that fails (any first byte other than 0xff opens one).
    sock.setsockopt(zmq.ZAP_DOMAIN, b"sparsekv")
    return sock


def _frame_property(frames, name, unreadable):
    """libzmq's property ``name`` of received frames (``unreadable`` if libzmq has none);
    None for plain bytes (an in-process call)."""
    get = getattr(frames[0], "get", None) if frames else None
    if get is None:
        return None
    try:
        return get(name)
    except Exception:  # noqa: BLE001 - zmq.ZMQError: no such property (an older or newer libzmq)
        return unreadable


def peer_address(frames) -> str | None:
    """libzmq's ``Peer-Address`` of received frames ("" if unreadable); None for plain
    bytes (an in-process call)."""
    return _frame_property(frames, "Peer-Address", "")


def src_fd(frames) -> int | None:
    """The descriptor of the connection received frames came on (libzmq's ``ZMQ_SRCFD``
    property: deprecated, present in 4.3); None for plain bytes or when unreadable."""
    fd = _frame_property(frames, zmq.SRCFD, None)
    return fd if type(fd) is int and fd >= 0 else None
