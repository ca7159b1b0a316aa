"""Settings for the whole test run.

vLLM's usage statistics stay off: set here, at import (before any test module imports vllm), so the test process
and every service it starts (they inherit os.environ) see them. A value the caller already exported wins. So is
vLLM's own host (it would otherwise probe a public address to find one), and the test process may reach
nothing but this machine (tests/loopback_guard.py).

The tiny Llama and its offline greedy reference are session fixtures: the real-engine modules that compare with the
reference share one model folder and one `vllm.LLM` run (a vLLM start-up each) instead of one per module.
"""

import os
import tempfile

import pytest
from vllm_fixtures import OfflineReference, import_vllm_or_reason  # imports no vLLM

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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """The tiny random Llama's folder (services/engine/test_model.py), built once; skips where vLLM cannot run."""
    if (reason := import_vllm_or_reason()) is not None:
        pytest.skip(reason)
    from octoserve.services.engine.test_model import build_test_model

    return build_test_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def offline_reference(tiny_llama_dir, tmp_path_factory):
    reference = OfflineReference(tiny_llama_dir, tmp_path_factory.mktemp("reference") / "reference.json")
    yield reference
    reference.stop()
