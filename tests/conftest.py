"""Settings for the whole test run.

vLLM's usage statistics stay off: set here, at import (before any test module imports vllm), so the test process
and every service it starts (they inherit os.environ) see them. A value the caller already exported wins. So is
vLLM's own host (it would otherwise probe a public address to find one), and the test process may reach
nothing but this machine (tests/loopback_guard.py).
"""

import os
import tempfile

import pytest

import loopback_guard

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

loopback_guard.install()


@pytest.fixture
def temp_dirs_in_tmp_path(tmp_path, monkeypatch):
    """For tests whose harness starts a node without a run directory (`start_node(run_dir=None)` makes one with
    `tempfile.mkdtemp`): every temp directory this process makes lands under the test's tmp_path, not /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path
