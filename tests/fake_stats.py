"""A stand-in for the daemon's stats socket, for the command line's side of its answers."""

from __future__ import annotations

import contextlib
import os
import socket
import threading


@contextlib.contextmanager
def fake_stats_socket(run_dir: str, answer):
    """A stand-in for the daemon's stats socket in ``run_dir``: ``answer(conn)`` for every
    connection it accepts, on a thread, until the block ends (the listener closed then)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(os.path.join(run_dir, "stats.sock"))
    srv.listen(8)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:  # closed: the block ended
                return
            answer(c)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield
    finally:
        srv.close()
