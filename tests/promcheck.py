"""Checks of Prometheus text: prometheus_client's own parser, and ``promtool check
metrics`` (Debian package ``prometheus``) when it is installed.

Imported by test modules as ``promcheck`` (``tests/`` is on ``sys.path``, as for ``helpers``).
"""

from __future__ import annotations

import shutil
import subprocess

from prometheus_client.parser import text_string_to_metric_families


def families(text: str) -> dict:
    """Metric families by name (counters without their ``_total``); raises on bad text."""
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out, f"family {fam.name} twice"
        assert fam.documentation.strip(), f"{fam.name} has no help"
        out[fam.name] = fam
    return out


def values(fams: dict) -> dict:
    """``{'name{label="v",...}': value}`` of every sample (labels sorted by name)."""
    out = {}
    for fam in fams.values():
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def promtool_check(text: str) -> bool:
    """Run ``promtool check metrics`` on ``text``; fail on any complaint. False (nothing
    checked) when promtool is not installed."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return False
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (r.stdout, r.stderr)
    return True
