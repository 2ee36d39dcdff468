"""What ``Client.submit_topk`` returns: a request on the wire (:class:`Pending`), or one
whose result needs no reply (:class:`Ready`, device wait)."""

from __future__ import annotations

from .errors import ClientInUse, DaemonUnavailable, SparseKVError


class Pending:
    """A request on the wire; ``wait()`` returns its reply (or raises its error)."""

    _error: SparseKVError | None = None  # the error its reply said (raised by every wait)
    _raised = False  # a wait raised (its own error, or an earlier request's in its place)

    def __init__(self, client, req_id: int, convert):
        self._client, self._id, self._convert = client, req_id, convert
        self._result = None
        self._done = False

    def wait(self):
        if self._error is not None:
            raise self._error
        if not self._done:
            try:
                header, arrays = self._client._await_reply(self._id)
            except SparseKVError as e:
                # Its own reply (read once), not another request's error, a lost daemon, nor
                # another thread holding the client (the wait may be made again).
                if isinstance(e, ClientInUse):
                    raise
                if not isinstance(e, DaemonUnavailable) and self._id not in self._client._replies:
                    self._error = e
                self._raised = True
                raise
            self._result = self._convert(header, arrays)
            self._done = True
        return self._result

    def __del__(self):
        # Dropped unread: its reply is not kept for nobody. An error in it is raised by a
        # later request (as a deferred request's) unless a wait of it raised one already.
        client = getattr(self, "_client", None)
        if client is not None and not self._done and self._error is None:
            try:
                client._abandon(self._id, quietly=self._raised)
            except Exception:  # noqa: BLE001 - at interpreter exit, or a client torn down
                pass


class Ready(Pending):
    """A request whose result needs no reply (device wait): ``wait()`` returns it at once;
    the reply is read later, and an error in it is raised by a later call."""

    def __init__(self, result):
        self._result, self._done = result, True
