"""Log lines a client can cause are limited per cause (daemon/ratelog.py), and a real
daemon's journal stays short under a flood of connections closed without HELLO."""

import logging
import os
import socket

import pytest

import helpers
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.daemon.ratelog import RateLimitedLog


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_each_cause_logs_its_burst_per_window_then_one_summary_with_the_count(caplog):
    clock = Clock()
    rlog = RateLimitedLog(logging.getLogger("t.ratelog"), interval_s=10, burst=3, clock=clock)
    with caplog.at_level(logging.INFO, logger="t.ratelog"):
        for i in range(50):
            rlog.log("a", logging.INFO, "a %d", i)
        rlog.log("b", logging.INFO, "b")  # another cause has its own window
        assert [r.getMessage() for r in caplog.records] == ["a 0", "a 1", "a 2", "b"]
        assert rlog.left_out("a") == 47
        clock.t = 5
        rlog.flush()  # the window is not over: no summary yet
        assert len(caplog.records) == 4
        clock.t = 10
        rlog.flush()
        summary = caplog.records[-1]
        assert summary.levelno == logging.WARNING and len(caplog.records) == 5
        assert "47 more log lines of cause 'a' left out in the last 10 s (3 logged" in summary.getMessage()
        rlog.log("a", logging.INFO, "a again")  # a new window
        assert caplog.records[-1].getMessage() == "a again" and rlog.left_out("a") == 0


@pytest.mark.waits  # for the cause's 10 s window to end
def test_a_flood_of_connections_without_hello_logs_a_few_lines_and_a_summary(tmp_path):
    log_path = tmp_path / "d.log"
    with PrivateDaemon(pool_bytes=16 << 20, backend="cpu", extra_args=["--hello-timeout-s", "0.2"],
                       log_path=str(log_path), start_timeout_s=30) as d:
        path = os.path.join(d.run_dir, "control.sock")
        socks = []
        for _ in range(60):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            socks.append(s)
        helpers.wait_for(lambda: helpers.stats_json(d.run_dir)["connections_expired"] == 60, timeout_s=10,
                         what="every silent connection closed")
        for s in socks:
            s.close()
        # the summary comes once the cause's 10 s window is over (the table flushes each second)
        helpers.wait_for(lambda: "left out" in log_path.read_text(), timeout_s=15, interval_s=0.2,
                         what="the summary line")
        text = log_path.read_text()
        assert text.count("no HELLO within") == 10
        assert "50 more log lines of cause 'connection without HELLO' left out" in text
