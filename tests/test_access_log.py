"""The router's access log (router/access_log.py): what one line holds for each outcome, the modes and the ok
sampling, and the fault plan's parsing (services/faults.py). Real RequestStates and real typed errors, a log
capture."""

from __future__ import annotations

import json
import logging

import grpc
import pytest

from octoserve.router.access_log import AccessLog
from octoserve.router.servicer import RequestState
from octoserve.services.core.errors import InvalidArgument, Overloaded
from octoserve.services.core.types import Priority
from octoserve.services.rpc import convert
from octoserve.services.rpc import status as rpc_status
from octoserve.v1 import generate_pb2 as gen_pb


def _lines(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "octoserve.router.access"]


def _state(request_id: str, instances=("c0",)) -> RequestState:
    req = gen_pb.GenerateRequest(model="llama-3-8b", token_ids=gen_pb.TokenIds(ids=list(range(100, 164))),
                                 max_tokens=8, priority=gen_pb.INTERACTIVE)
    spec = convert.spec_from_public(req, request_id, 0.0)
    return RequestState(spec, tuple(instances), 16, wall_start_s=10.0)


def _finish_ok(st: RequestState) -> None:
    st.first_token_s = 10.25
    st.num_sent, st.num_cached_tokens = 8, 32
    st.finish_reason = gen_pb.LENGTH


def test_ok_line_has_ttft_tokens_cached_and_instances(caplog):
    caplog.set_level(logging.INFO, "octoserve.router.access")
    st = _state("r1")
    _finish_ok(st)
    AccessLog("all").finished(st, now_s=11.0)
    assert _lines(caplog) == [{
        "request_id": "r1", "model": "llama-3-8b", "tier": "INTERACTIVE", "outcome": "ok", "code": "OK",
        "tokens_out": 8, "cached_tokens": 32, "instances": ["c0"], "e2e_ms": 1000.0, "ttft_ms": 250.0,
    }]


def test_refusal_line_has_the_reason_and_retry_hint(caplog):
    caplog.set_level(logging.INFO, "octoserve.router.access")
    req = gen_pb.GenerateRequest(model="llama-3-8b", request_id="r2", priority=gen_pb.BATCH)
    error = Overloaded("llama-3-8b", Priority.BATCH, 1350, "no instance has KV headroom")
    AccessLog("errors").refused(req, "", error)
    (line,) = _lines(caplog)
    assert line["request_id"] == "r2" and line["tier"] == "BATCH"
    assert (line["outcome"], line["code"], line["retry_after_ms"]) == ("refused", "RESOURCE_EXHAUSTED", 1350)
    assert line["reason"] == error.message and line["instances"] == []


def test_lost_worker_line_names_every_instance_and_the_hint(caplog):
    caplog.set_level(logging.INFO, "octoserve.router.access")
    st = _state("r3", ("p0", "d0"))
    st.served_by += ["p1", "d1"]
    st.rerouted = 1
    st.first_token_s, st.num_sent = 10.5, 3
    message = "d1 unavailable: connection lost; retry it"
    st.fail(rpc_status.RpcStatus(grpc.StatusCode.UNAVAILABLE, message,
                                 rpc_status.retry_trailers(grpc.StatusCode.UNAVAILABLE, message, 200)))
    AccessLog("errors").finished(st, now_s=12.0)
    (line,) = _lines(caplog)
    assert line["instances"] == ["p0", "d0", "p1", "d1"] and line["rerouted"] == 1
    assert (line["outcome"], line["code"], line["retry_after_ms"], line["reason"]) == ("failed", "UNAVAILABLE", 200, message)
    assert line["tokens_out"] == 3 and line["ttft_ms"] == 500.0


def test_a_client_that_left_is_logged_cancelled(caplog):
    caplog.set_level(logging.INFO, "octoserve.router.access")
    AccessLog("errors").finished(_state("r4"), now_s=10.1)
    (line,) = _lines(caplog)
    assert (line["outcome"], line["code"], line["tokens_out"]) == ("cancelled", "CANCELLED", 0)
    assert "ttft_ms" not in line


def test_errors_mode_samples_one_in_n_ok_requests_and_every_failure(caplog):
    caplog.set_level(logging.INFO, "octoserve.router.access")
    access = AccessLog("errors", sample_every=3)
    for i in range(7):
        st = _state(f"ok{i}")
        _finish_ok(st)
        access.finished(st, now_s=11.0)
        access.refused(gen_pb.GenerateRequest(model="m", request_id=f"bad{i}"), "", InvalidArgument("max_tokens", "too big"))
    ids = [line["request_id"] for line in _lines(caplog)]
    assert [i for i in ids if i.startswith("ok")] == ["ok0", "ok3", "ok6"]
    assert [i for i in ids if i.startswith("bad")] == [f"bad{i}" for i in range(7)]


def test_off_writes_nothing_and_bad_settings_say_what_to_change(caplog):
    caplog.set_level(logging.INFO, "octoserve.router.access")
    access = AccessLog("off")
    st = _state("r5")
    access.finished(st, now_s=11.0)
    access.refused(gen_pb.GenerateRequest(model="m"), "", InvalidArgument("model", "empty"))
    assert _lines(caplog) == []
    with pytest.raises(ValueError, match="one of off, errors, all"):
        AccessLog("verbose")
    with pytest.raises(ValueError, match="sample_every must be >= 1"):
        AccessLog("errors", sample_every=0)


def test_lines_are_json_through_the_service_formatter():
    from octoserve.services.rpc.server import JsonLineFormatter

    record = logging.LogRecord("octoserve.router.access", logging.INFO, __file__, 1, "request", (), None)
    record.fields = {"request_id": "r6", "instances": ["c0"]}
    entry = json.loads(JsonLineFormatter("router").format(record))
    assert entry["msg"] == "request" and entry["request_id"] == "r6" and entry["instances"] == ["c0"]


def test_fault_plan_parses_and_cycles_and_names_bad_input():
    from octoserve.services.faults import FaultPlan, KVTransferFault

    plan = FaultPlan.parse("kv_transfer=slow:2.5,corrupt,ok")
    assert [plan.next_kv_transfer() for _ in range(4)] == [
        KVTransferFault("slow", 2.5), KVTransferFault("corrupt"), KVTransferFault("ok"), KVTransferFault("slow", 2.5)]
    assert FaultPlan.parse("").next_kv_transfer() is None
    with pytest.raises(ValueError, match="slow needs seconds"):
        FaultPlan.parse("kv_transfer=slow:soon")
    with pytest.raises(ValueError, match="unknown fault 'disk'"):
        FaultPlan.parse("disk=full")
