"""Live gang leases: the scheduler's arbiter grants every step of the gang members' sim engines over GangSteps.

In-process: the real scheduler servicer on a real gRPC server on 127.0.0.1, and node-gang.yaml's nine sim engines
(the 70B at TP=8 and eight 8B replicas on the same GPUs), each with its GangGate, dilated so that a step is long
against the machine's scheduling noise. Requests go straight to the engines. Checked:
- no LM step overlaps any SM step, on the engines' own clock (the barrier holds live);
- every step an engine ran was granted: the arbiter counted exactly the steps the engines' gates logged;
- every request finished with its full length; both sides got steps and the holder switched;
- an idle member hears of the other side's work by the arbiter's notice, with no grant (its load report turns to
  shared rates before a prompt reaches it);
- on seed 003's node (deadline shape), SMs that only decode lend their ITL tail: the LM is told so by a notice and
  its long prompt runs in one step past the SMs' latest start;
- a stream that does not open with a member's HELLO, or sends a malformed report, is refused; a gang member needs a
  scheduler.
The process-level agreement with the simulator is `python -m octoserve.services.lab.gang_agreement` (BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest

from octoserve.services.config import load_node_config
from octoserve.services.core.types import FinishReason, RequestSpec, SamplingParams
from octoserve.services.engine.factory import make_engine
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.services.rpc.server import start_service
from octoserve.services.scheduler.gang_live import attach_gang_gate
from octoserve.services.scheduler.service import scheduler_spec

session_loop = pytest.mark.asyncio(loop_scope="session")

CONFIG = Path(__file__).resolve().parent.parent / "services" / "configs" / "node-gang.yaml"
SEED003_CONFIG = CONFIG.with_name("node-seed003.yaml")
TIME_SCALE = 20.0


def spec(request_id: str, model: str, num_prompt: int, max_tokens: int) -> RequestSpec:
    prompt = tuple(100 + (i * 7 + len(request_id)) % 3000 for i in range(num_prompt))
    return RequestSpec(request_id, model, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_s=asyncio.get_running_loop().time() / TIME_SCALE)


def gates_of(engines: dict) -> dict:
    return {iid: e.gate for iid, e in engines.items()}


async def run(engine, s: RequestSpec, first_token: asyncio.Event | None = None):
    last, n = None, 0
    async for out in engine.generate(s):
        n += len(out.new_token_ids)
        last = out
        if n and first_token is not None:
            first_token.set()
    return last, n


@contextlib.asynccontextmanager
async def gang_node(node, on_engine=None):
    """The scheduler on 127.0.0.1 and every member's sim engine with its gate, started; yields (engines, the group)
    once the group's driver runs (all members said HELLO). `on_engine(instance id, engine)` runs before the start."""
    sched_spec, servicer = scheduler_spec(node, port=0, metrics_port=None, grace_s=0.5)
    running = await start_service(sched_spec)
    engines = {}
    try:
        for inst in node.instances:
            engine = make_engine(node, inst.id, time_scale=TIME_SCALE)
            attach_gang_gate(engine, node, inst.id, running.address, TIME_SCALE)
            if on_engine is not None:
                on_engine(inst.id, engine)
            engines[inst.id] = engine
        await asyncio.gather(*(e.start() for e in engines.values()))
        group = servicer.gang.groups["lm-0"]
        for _ in range(200):
            if group.driver is not None:
                break
            await asyncio.sleep(0.01)
        assert group.driver is not None, "the group's driver starts once every member said HELLO"
        yield engines, group, servicer
    finally:
        await asyncio.gather(*(e.stop() for e in engines.values()))
        await running.shutdown()


@session_loop
async def test_gang_members_step_only_on_grants_and_never_overlap():
    node = load_node_config(str(CONFIG))
    async with gang_node(node) as (engines, group, servicer):

        lm_model, sm_model = engines["lm-0"].model, engines["sm-0"].model
        # An idle SM is told that the LM has work the moment the arbiter sees it (a notice, not a grant): its load
        # report turns to shared rates before any prompt reaches it.
        assert not any(e.reporter.shared for e in engines.values())
        first = asyncio.ensure_future(run(engines["lm-0"], spec("lm-first", lm_model, 200, 4)))
        for _ in range(400):
            if engines["sm-7"].reporter.shared:
                break
            await asyncio.sleep(0.005)
        assert engines["sm-7"].reporter.shared and gates_of(engines)["sm-7"].num_notices >= 1
        assert gates_of(engines)["sm-7"].num_grants == 0
        assert not engines["lm-0"].reporter.shared  # the SMs have nothing: the LM steps alone
        await first
        requests = [(engines["lm-0"], spec(f"lm-{i}", lm_model, 300 + 50 * i, 12)) for i in range(4)]
        requests += [(engines[f"sm-{i % 8}"], spec(f"sm-{i}", sm_model, 200 + 10 * i, 16)) for i in range(16)]
        results = await asyncio.wait_for(asyncio.gather(*(run(e, s) for e, s in requests)), timeout=240)
        for (_, s), (last, n) in zip(requests, results):
            assert last.finish_reason is FinishReason.LENGTH and n == s.sampling.max_tokens, s.request_id

        gates = gates_of(engines)
        lm_steps = list(gates["lm-0"].steps)
        sm_steps = [iv for iid, g in gates.items() if iid != "lm-0" for iv in g.steps]
        assert lm_steps and sm_steps
        for b, e in lm_steps:
            for sb, se in sm_steps:
                assert se <= b or e <= sb, f"LM step {b:.4f}-{e:.4f} overlaps an SM step {sb:.4f}-{se:.4f}"
        stats = group.arbiter.stats
        assert stats.num_lm_steps == len(lm_steps)
        assert stats.num_sm_steps == len(sm_steps)
        assert stats.num_switches >= 2
        # Grants say when the other side had work, and the engines' load reports follow (shared-step rates).
        for iid in ("lm-0", "sm-0"):
            assert 0 < gates[iid].num_shared_grants <= gates[iid].num_grants
        figures = servicer.gang.stats()["lm-0"]
        assert figures["lm_steps"] == len(lm_steps) and figures["decisions"] > 0


@session_loop
async def test_a_member_that_planned_nothing_answers_the_next_grant():
    """Under the pessimistic profile the LM's first prefill chunk often does not fit the cap the arbiter offers while
    the SMs decode: the LM plans nothing (NOTHING) and keeps its work. The arbiter grants it again later with a
    longer cap, before anything new arrives at the LM; the LM must answer that grant (it once waited for new work
    only, the grant went unanswered and the whole group stalled). Checked: every request finishes in full and the LM
    was told to start with nothing to run at least once."""
    from octoserve.services.config import load_with_overrides

    node = load_with_overrides(str(CONFIG), [], "pessimistic")
    async with gang_node(node) as (engines, group, _):
        lm_model, sm_model = engines["lm-0"].model, engines["sm-0"].model
        requests = [(engines[f"sm-{i % 8}"], spec(f"sm-{i}", sm_model, 2000, 24)) for i in range(8)]
        decoding = [asyncio.Event() for _ in requests]
        sm_tasks = [asyncio.create_task(run(e, s, d)) for (e, s), d in zip(requests, decoding)]
        # The SMs hold the GPUs, decoding (each has its first token), when the LM's long prompt arrives.
        await asyncio.wait_for(asyncio.gather(*(d.wait() for d in decoding)), timeout=120)
        assert not any(t.done() for t in sm_tasks)  # 23 decode steps each still to run
        lm = (engines["lm-0"], spec("lm-0", lm_model, 2500, 8))
        results = await asyncio.wait_for(asyncio.gather(*sm_tasks, run(*lm)), timeout=180)
        for (_, s), (last, n) in zip([*requests, lm], results):
            assert last.finish_reason is FinishReason.LENGTH and n == s.sampling.max_tokens, s.request_id
        assert group.driver.stats.num_blocked >= 1  # the path under test ran
        assert group.arbiter.stats.num_lm_steps == len(engines["lm-0"].gate.steps) > 0


@session_loop
async def test_seed_003s_lm_prompt_steps_past_the_deadlines_of_sms_that_lend_their_tail():
    """Seed 003's node live (the deadline shape): four 8B replicas decoding, their ITL tails untouched, lend them;
    the arbiter tells the 180B model so over the stream (a notice: its load report predicts the longer step), and
    its 900-token prompt runs in one step of ~115 modelled ms, past the SMs' latest start (their 65 ms ITL less a
    step: no LM step may run longer than ~58 ms while an SM that does not lend decodes). Every request finishes."""
    node = load_node_config(str(SEED003_CONFIG))
    lent_told = []

    def record_lending(instance_id: str, engine) -> None:
        if instance_id == "lm-0":
            told = engine.gate.on_sharing

            def on_sharing(shared: bool, tail_lent: bool) -> None:
                lent_told.append(tail_lent)
                told(shared, tail_lent)

            engine.gate.on_sharing = on_sharing

    async with gang_node(node, record_lending) as (engines, group, _):
        gate = engines["lm-0"].gate
        lm_model, sm_model = engines["lm-0"].model, engines["sm-0"].model
        requests = [(engines[f"sm-{i}"], spec(f"sm-{i}", sm_model, 20, 40)) for i in range(4)]
        decoding = [asyncio.Event() for _ in requests]
        sm_tasks = [asyncio.create_task(run(e, s, d)) for (e, s), d in zip(requests, decoding)]
        await asyncio.wait_for(asyncio.gather(*(d.wait() for d in decoding)), timeout=60)
        for _ in range(200):  # the LM is told, idle, that the SMs lend: its report predicts the longer step
            if engines["lm-0"].reporter.tail_lent:
                break
            await asyncio.sleep(0.005)
        assert engines["lm-0"].reporter.tail_lent and True in lent_told
        lm = (engines["lm-0"], spec("lm-0", lm_model, 900, 4))
        results = await asyncio.wait_for(asyncio.gather(*sm_tasks, run(*lm)), timeout=120)
        for (_, s), (last, n) in zip([*requests, lm], results):
            assert last.finish_reason is FinishReason.LENGTH and n == s.sampling.max_tokens, s.request_id
        longest_s = max(e - b for b, e in gate.steps) / TIME_SCALE  # loop seconds to modelled ones
        assert longest_s > 0.090, longest_s  # the whole prompt in one step, past the SMs' ~58 ms latest start
        assert group.arbiter.stats.num_overruns == 0


@session_loop
async def test_a_stream_without_a_members_hello_or_malformed_is_refused():
    node = load_node_config(str(CONFIG))
    sched_spec, _ = scheduler_spec(node, port=0, metrics_port=None, grace_s=0.5)
    running = await start_service(sched_spec)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            call = s_grpc.SchedulerStub(channel).GangSteps(
                iter([s_pb.GangReport(instance_id="not-a-member", event=s_pb.GangReport.HELLO)]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "not-a-member" in err.value.details()
            raw = channel.stream_stream("/octoserve.v1.Scheduler/GangSteps", request_serializer=lambda b: b,
                                        response_deserializer=s_pb.GangGrant.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in raw(iter([b"\xff\xff\xff"])):  # not a GangReport
                    pass
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await running.shutdown()


def test_a_gang_member_needs_a_scheduler():
    node = load_node_config(str(CONFIG))
    engine = make_engine(node, "sm-0")
    with pytest.raises(ValueError, match="--scheduler"):
        attach_gang_gate(engine, node, "sm-0", "", 1.0)
    attach_gang_gate(engine, load_node_config(None), "sm-0", "", 1.0)  # outside gang groups: nothing to attach
    assert engine.gate is None


@pytest.mark.slow
@pytest.mark.agreement
@pytest.mark.usefixtures("temp_dirs_in_tmp_path")  # gang_agreement.run starts the node without a run directory
def test_live_gang_node_and_simulator_agree_within_tolerance():
    """The whole time-shared node as processes (scheduler granting every member step, nine workers, router), K = 20,
    against the simulator on the same seed-000 trace: goodput and TTFT / ITL P95 within ±15 %. About three minutes."""
    from octoserve.services.lab.agreement import TOLERANCE, cap_outputs
    from octoserve.services.lab.gang_agreement import run
    from octoserve.services.workload import PROFILES, generate_trace, scaled

    # 7 modelled seconds (62 requests in the measurement window, 35 refused on both sides; 140 s of arrivals at K = 20):
    # three runs differed by at most 2.4 % (goodput -0.2 %, TTFT P95 +2.2 %, ITL P95 +2.4 %), against 5.3 % over 10 s.
    profile = scaled(PROFILES["seed-000"], rate_rps=20.0, duration_s=7.0)
    trace = cap_outputs(generate_trace(profile, 0), 96)
    result = run(str(CONFIG), trace, 20.0, duration_s=7.0, slo=profile.slo)
    agreement = result["agreement"]
    # No admitted request fails; a prompt no idle instance could prefill within its TTFT SLO is refused on both
    # sides (FAILED_PRECONDITION live, a refusal in the simulator).
    failed = [r for r in result["records"] if r.error]
    assert not failed, failed
    assert agreement.live.overall.num_offered == agreement.virtual.overall.num_offered
    assert all(abs(d) <= TOLERANCE for d in agreement.relative_differences().values()), agreement.table()
    live, virtual = result["live_gang"]["lm-0"], result["virtual_gang"]["lm-0"]
    assert live["lm_steps"] > 0 and live["sm_steps"] > 0 and live["switches"] > 0
    assert live["overruns"] == 0  # every live step fit the cap the arbiter gave it


@pytest.mark.parametrize("text,problem", [(None, "No such file"), ("traffic: [\n", "is not valid YAML")])
def test_gang_agreement_names_an_unusable_workload_file(tmp_path, capsys, text, problem):
    from octoserve.services.lab.gang_agreement import main

    path = tmp_path / "w.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as stop:
        main(["--workload", str(path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--workload {path}: " in err and problem in err
