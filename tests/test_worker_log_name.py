"""A worker process logs under its instance's role: a colocated instance is not a `decode_worker`."""

import argparse

import pytest

from octoserve.services.rpc.worker_main import log_name


@pytest.mark.parametrize(("prog", "config", "instance", "expected"), [
    ("decode_worker", None, "sm-0", "colocated_worker:sm-0"),
    ("decode_worker", None, "lm-0", "colocated_worker:lm-0"),
    ("decode_worker", "services/configs/node-disagg.yaml", "lm-decode-0", "decode_worker:lm-decode-0"),
    ("prefill_worker", "services/configs/node-disagg.yaml", "lm-prefill-0", "prefill_worker:lm-prefill-0"),
])
def test_log_name_follows_the_role(prog, config, instance, expected):
    assert log_name(prog, argparse.Namespace(config=config, instance=instance)) == expected
