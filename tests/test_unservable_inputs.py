"""`simulate` on requests that can never be served: said before the run, naming the file and the line or key.

- A workload length the sampler would clip (`prompt_len: {kind: fixed, value: -10}` read as 1 token) is bad input:
  one line, exit 2, before any work.
- Two trace lines with the same request_id are bad input, naming both lines.
- A trace line whose prompt (or prompt + max_tokens) is over its model's context window is data, not a typo: it is
  replayed and refused as the router refuses it, and a warning on stderr names the line and why, before the run.
The commands run as subprocesses from a temporary directory outside the checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from octoserve.services.usage import UsageError
from octoserve.services.workload_io import MAX_WINDOW_WARNINGS, load_trace, workload_from_dict

# The sources, not the compiled simulator modules: an extension older than its edited source adds a warning to
# stderr, and these tests compare stderr whole.
ENV = {**os.environ, "OCTOSERVE_PURE_PYTHON": "1"}


def octoserve(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "octoserve.services.cli", *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=ENV)


def workload(prompt_len: str) -> str:
    return ("name: mine\nrate_rps: 20\nduration_s: 10\ntraffic:\n  - model: llama-3-8b\n    share: 1.0\n"
            f"    prompt_len: {prompt_len}\n    output_len: {{kind: fixed, value: 100}}\n")


def line(**fields) -> str:
    return json.dumps({"arrival_s": 0.0, "model": "llama-3-8b", "prompt_len": 500, "output_len": 100, **fields})


@pytest.mark.parametrize("prompt_len, message", [
    ("{kind: fixed, value: -10}", "value is -10; a fixed length's value is a whole number of tokens >= 1"),
    ("{kind: fixed, value: 0}", "value is 0; a fixed length's value is a whole number of tokens >= 1"),
    ("{kind: fixed, value: 2.5}", "value is 2.5; a fixed length's value is a whole number of tokens >= 1"),
    ("{kind: fixed}", "a fixed length needs value; value is missing"),
    ("{kind: uniform, lo: -5, hi: 10}", "lo is -5; a uniform length's lo is a whole number of tokens >= 1"),
    ("{kind: lognormal, mean: 900, sigma: 0.5, min_tokens: 0}", "min_tokens is 0; it is a whole number of tokens >= 1"),
])
def test_a_workload_length_that_would_be_clipped_is_bad_input_naming_the_key(tmp_path, prompt_len, message):
    (tmp_path / "w.yaml").write_text(workload(prompt_len))
    done = octoserve("simulate", "--workload", "w.yaml", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"octoserve simulate: error: w.yaml: traffic[0].prompt_len: {message}\n")


def test_a_valid_length_loads_unchanged():
    p = workload_from_dict({"rate_rps": 1, "duration_s": 1, "traffic": [
        {"model": "m", "share": 1, "prompt_len": {"kind": "uniform", "lo": 1, "hi": 9},
         "output_len": {"kind": "lognormal", "mean": 50, "sigma": 0.3, "min_tokens": 2, "max_tokens": 80}}]}, "w.yaml")
    t = p.traffic[0]
    assert (t.prompt_len.kind, t.prompt_len.lo, t.prompt_len.hi) == ("uniform", 1, 9)
    assert (t.output_len.min_tokens, t.output_len.max_tokens) == (2, 80)


def test_a_request_id_used_twice_in_a_trace_is_bad_input_naming_both_lines(tmp_path):
    (tmp_path / "t.jsonl").write_text("\n".join([line(request_id="a"), line(request_id="b"), "",
                                                 line(arrival_s=1.0, request_id="a")]) + "\n")
    done = octoserve("simulate", "--trace", "t.jsonl", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "octoserve simulate: error: t.jsonl:4: request_id 'a' is already the id of line 1; give each request "
               "its own request_id (or leave it out)\n")


def test_a_trace_line_over_the_context_window_is_named_on_stderr_then_refused(tmp_path):
    # The default node serves both models with 8,192-token windows.
    (tmp_path / "t.jsonl").write_text("\n".join([
        line(),
        line(arrival_s=0.5, prompt_len=9000),  # the prompt alone is over the window
        line(arrival_s=1.0, prompt_len=8000, output_len=300),  # prompt + max_tokens is
        line(arrival_s=1.5, prompt_len=8000, output_len=192, tier="BATCH"),  # exactly the window: served (BATCH:
        # its 10 s TTFT SLO leaves room for an 8,000-token prefill)
    ]) + "\n")
    done = octoserve("simulate", "--trace", "t.jsonl", "--warmup", "0s", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[:3] == [
        "warning: t.jsonl:2: the prompt of 9000 tokens does not fit the 8192-token context window of llama-3-8b: it "
        "can never be served, so it is refused (counted in refused%)",
        "warning: t.jsonl:3: max_tokens 300 + prompt 8000 tokens exceeds the 8192-token context window of "
        "llama-3-8b: it can never be served, so it is refused (counted in refused%)",
        "simulating 4 requests of t at 2.66667 req/s for 1.5 s on 5 instances",
    ]
    row = next(r for r in done.stdout.splitlines() if r.startswith("llama-3-8b "))
    assert row.split()[1:4] == ["4", "50.0", "2"]  # offered, refused%, done: the two over the window refused


def test_past_ten_unservable_lines_the_rest_are_counted(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(line(arrival_s=float(i), prompt_len=9000) for i in range(MAX_WINDOW_WARNINGS + 3))
                    + "\n")
    trace = load_trace(path, context_windows={"llama-3-8b": 8192})
    assert len(trace) == MAX_WINDOW_WARNINGS + 3
    warnings = capsys.readouterr().err.splitlines()
    assert [w.split(": ")[1] for w in warnings[:-1]] == [f"{path}:{n}" for n in range(1, MAX_WINDOW_WARNINGS + 1)]
    assert warnings[-1] == (f"warning: {path}: 3 more requests can never be served (over their model's context "
                            "window); they are refused too")
    load_trace(path)  # without windows (a command that does not know the node): nothing to say
    assert capsys.readouterr().err == ""


def test_a_duplicate_request_id_is_refused_by_the_loader_too(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(line(request_id="r0000001") + "\n" + line() + "\n")  # line 2's default id is r0000001
    with pytest.raises(UsageError) as info:
        load_trace(path)
    assert str(info.value) == (f"{path}:2: request_id 'r0000001' is already the id of line 1; give each request its "
                               "own request_id (or leave it out)")
