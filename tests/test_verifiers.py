"""Verifiers and samples per prompt (issue 31 items 1, 2 and 5), through real runs on the scripted server."""

from __future__ import annotations

import asyncio
import json
import shutil

import attrs
import pytest

import hermes_batch
from hermes_batch.testing import Reply, RoutedScript, VerifierContract, write_dataset


def solves(content: str):
    """A script whose session writes ``content`` to answer.txt with the terminal tool, then answers."""

    def script(request):
        if request.turn == 0:
            command = f"printf '%s' '{content}' > answer.txt"
            return Reply(reasoning="I will write it.", tool_calls=[("terminal", {"command": command})])
        return Reply(content=f"The answer is {content}.", reasoning="Done.")

    return script


def by_sample(*contents: str):
    """Sample i writes contents[i] (the last one for later samples)."""
    return RoutedScript(lambda sample: solves(contents[min(sample, len(contents) - 1)]), by="sample")


TESTS = "test \"$(cat answer.txt)\" = 42"


def kept(runner, run_name=None) -> list[dict]:
    records = runner.records("trajectories.jsonl", run_name)
    records += [d["trajectory"] for d in runner.records("discarded.jsonl", run_name)]
    return sorted(records, key=lambda r: (r["prompt_index"], r["metadata"]["sample_index"]))


def test_the_command_verifier_rewards_what_the_session_left_in_the_sandbox(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("41", "42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Write 42 to answer.txt", "tests": TESTS}])
    result = runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "2")
    assert result.exit_code == 0, result.output
    records = kept(runner)
    meta = [r["metadata"] for r in records]
    assert [m["sample_index"] for m in meta] == [0, 1]
    assert [(m["reward"], m["verified"], m["passed"]) for m in meta] == [(0.0, True, False), (1.0, True, True)]
    results = [json.loads(m["verifiers"]) for m in meta]
    assert [r[0]["reason"] for r in results] == ["exit status 1", "exit status 0"]
    assert meta[0]["content_key"] != meta[1]["content_key"]
    assert all(r[0]["error"] == "" and r[0]["duration_s"] > 0 for r in results)


def test_stop_on_success_stops_a_row_at_its_first_passing_sample(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("1", "2", "42", "42"))
    prompts = [{"prompt": "Write 42 to answer.txt", "tests": TESTS},
               {"prompt": "Write 42, never", "tests": "false"}]
    dataset = write_dataset(tmp_path / "d.jsonl", prompts)
    result = runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "5", "--stop_on_success",
                           "--batch_size", "1")
    assert result.exit_code == 0, result.output
    by_row = {}
    for record in kept(runner):
        by_row.setdefault(record["prompt_index"], []).append(record["metadata"])
    assert [m["passed"] for m in by_row[0]] == [False, False, True]  # the third passed: no fourth or fifth
    assert [m["sample_index"] for m in by_row[0]] == [0, 1, 2]
    assert len(by_row[1]) == 5 and not any(m["passed"] for m in by_row[1])  # never passes: all five
    assert runner.server.sessions_for(prompts[0]["prompt"]) == 3
    checkpoint = json.loads((runner.folder() / "checkpoint.json").read_text())
    assert checkpoint["completed_batches"] == [0, 1] and checkpoint["prompts_finished"] == 8


def test_a_passing_sample_a_filter_discards_still_stops_its_row(runner, model_server, tmp_path):
    """As docs/verification.md says: passing is the verifiers' judgement; the no-reasoning filter discards the
    pass, the row samples no further, and a refilter without that filter brings the pass back."""
    def no_reasoning(request):
        if request.turn == 0:
            return Reply(content="", tool_calls=[("terminal", {"command": "printf 42 > answer.txt"})])
        return Reply(content="The answer is 42.")

    runner.server = model_server(no_reasoning)
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Write 42 to answer.txt", "tests": TESTS}])
    result = runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "4", "--stop_on_success")
    assert result.exit_code == 0, result.output
    assert runner.server.sessions_for("Write 42 to answer.txt") == 1
    discarded = runner.records("discarded.jsonl")
    assert [d["trajectory"]["metadata"]["passed"] for d in discarded] == [True] and not runner.records("trajectories.jsonl")
    rewards = json.loads((runner.folder() / "statistics.json").read_text())["rewards"]
    assert rewards["rows_passed"] == 1 and rewards["pass_at_k"]["1"] == 1.0
    assert runner.cli("refilter", str(runner.folder()), "--filter", "hallucinated-tools").exit_code == 0
    assert [r["metadata"]["passed"] for r in runner.records("trajectories.jsonl")] == [True]


def test_samples_each_get_a_sandbox_and_a_toolset_sample_of_their_own(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Write 42", "tests": "test ! -e seen && touch seen"}])
    result = runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "3")
    assert result.exit_code == 0, result.output
    meta = [r["metadata"] for r in kept(runner)]
    assert [m["passed"] for m in meta] == [True, True, True]  # no sample saw another's file
    assert len({m["content_key"] for m in meta}) == 3


def test_max_samples_counts_samples(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("42"))
    rows = [{"prompt": f"Write 42 #{i}", "tests": TESTS} for i in range(3)]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "2", "--max_samples", "3")
    assert result.exit_code == 0, result.output
    assert [(r["prompt_index"], r["metadata"]["sample_index"]) for r in kept(runner)] == [(0, 0), (0, 1), (1, 0)]
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["prompts"]["finished"] == 3  # the statistics count samples


class Hangs(hermes_batch.Verifier):
    name = "hangs"

    @attrs.frozen
    class Config:
        timeout: float = 0.5

    async def verify(self, ctx):
        await asyncio.sleep(3600)


class Crashes(hermes_batch.Verifier):
    name = "crashes"

    async def verify(self, ctx):
        raise RuntimeError("the verifier's own bug")


class Half(hermes_batch.Verifier):
    name = "half"

    async def verify(self, ctx):
        return hermes_batch.Verdict(0.5, "half way", "some output")


class VerifierPlugin:
    @hermes_batch.hookimpl
    def register_verifiers(self, register):
        register(Hangs)
        register(Crashes)
        register(Half)


def test_a_hanging_verifier_is_cut_off_and_a_crashing_one_gives_an_error_not_a_reward(runner, model_server, tmp_path):
    import time

    runner.plugins = (VerifierPlugin(),)
    runner.server = model_server(by_sample("42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": f"Write 42 #{i}", "tests": TESTS} for i in range(2)])
    started = time.monotonic()
    result = runner.invoke(dataset, "--verifier", "command", "--verifier", "hangs", "--verifier", "crashes")
    assert result.exit_code == 0, result.output  # the run goes on
    assert time.monotonic() - started < 60
    records = kept(runner)
    assert len(records) == 2
    for record in records:
        meta = record["metadata"]
        command, hangs, crashes = json.loads(meta["verifiers"])
        assert command["reward"] == 1.0 and command["error"] == ""
        assert hangs["error"] == "timed out after 0.5 s" and hangs["reward"] == 0.0
        assert 0.4 < hangs["duration_s"] < 5
        assert crashes["error"] == "RuntimeError: the verifier's own bug" and crashes["reward"] == 0.0
        assert (meta["verified"], meta["passed"], meta["reward"]) == (False, False, 0.0)


def test_the_reward_is_the_lowest_and_min_reward_says_what_passes(runner, model_server, tmp_path):
    runner.plugins = (VerifierPlugin(),)
    runner.server = model_server(by_sample("42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Write 42", "tests": TESTS}])
    result = runner.invoke(dataset, "--verifier", "command", "--verifier", "half", run_name="strict")
    assert result.exit_code == 0, result.output
    meta = kept(runner, "strict")[0]["metadata"]
    assert (meta["reward"], meta["verified"], meta["passed"]) == (0.5, True, False)
    assert json.loads(meta["verifiers"])[1] == {"name": "half", "reward": 0.5, "reason": "half way", "error": "",
                                                "output": "some output", "duration_s": pytest.approx(0, abs=0.5)}
    result = runner.invoke(dataset, "--verifier", "command", "--verifier", "half", "--min_reward", "0.5",
                           run_name="lenient")
    assert kept(runner, "lenient")[0]["metadata"]["passed"] is True


def test_the_command_verifier_takes_a_reward_file_for_partial_credit_but_a_failure_is_a_failure(
        runner, model_server, tmp_path):
    runner.server = model_server(by_sample("42"))
    rows = [{"prompt": "Partial", "tests": 'echo 0.25 > "$HERMES_REWARD_FILE"'},
            {"prompt": "Failed", "tests": 'echo 1 > "$HERMES_REWARD_FILE"; exit 1'}]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, "--verifier", "command")
    assert result.exit_code == 0, result.output
    partial, failed = (r["metadata"] for r in kept(runner))
    assert (partial["reward"], partial["verified"], partial["passed"]) == (0.25, True, False)
    assert json.loads(partial["verifiers"])[0]["reason"] == "reward file, exit status 0"
    # a status other than 0 fails, whatever the reward file says
    assert (failed["reward"], failed["verified"], failed["passed"]) == (0.0, True, False)
    assert json.loads(failed["verifiers"])[0]["reason"] == "exit status 1; the reward file it wrote does not count"


@pytest.mark.parametrize("written, reward, error", [
    ("1", 1.0, ""), ("0", 0.0, ""), ("0.5\n", 0.5, ""), (" .25 ", 0.25, ""), ("1.000", 1.0, ""),
    ("1_0", None, "not a plain decimal"), ("\u0661", None, "not ASCII"), ("1" * 256, None, "more than a reward's 40"),
    ("1" * 300, None, "more than 256 bytes"), ("1e308", None, "not a plain decimal"), ("+1", None, "without a sign"),
    ("-0", None, "without a sign"), ("nan", None, "not a plain decimal"), ("inf", None, "not a plain decimal"),
    ("0x1", None, "not a plain decimal"), ("1.5", None, "more than 1"), ("", None, "nothing"),
    ("0.5 0.5", None, "not a plain decimal"),
])
def test_a_reward_file_holds_a_plain_decimal_from_0_to_1_or_the_sample_is_not_verified(written, reward, error):
    from hermes_batch.default_plugins.verifiers import reward_from_file

    if error:
        with pytest.raises(ValueError, match=error):
            reward_from_file(written.encode())
    else:
        assert reward_from_file(written.encode()) == reward


def test_a_reward_the_file_cannot_state_leaves_the_sample_unverified(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("42"))
    rows = [{"prompt": "Underscore", "tests": 'echo 1_0 > "$HERMES_REWARD_FILE"'},
            {"prompt": "Link", "tests": 'ln -s /etc/passwd "$HERMES_REWARD_FILE"'}]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, "--verifier", "command")
    assert result.exit_code == 0, result.output
    for record in kept(runner):
        meta = record["metadata"]
        assert (meta["reward"], meta["verified"], meta["passed"]) == (0.0, False, False)
    errors = [json.loads(r["metadata"]["verifiers"])[0]["error"] for r in kept(runner)]
    assert "not a plain decimal" in errors[0]
    assert "the reward file cannot be read (a symbolic link)" in errors[1]


def test_a_reward_file_the_agent_left_does_not_count(runner, model_server, tmp_path):
    runner.server = model_server(solves_with("echo 1.0 > .hermes_batch_reward"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Cheat", "tests": "exit 1"}])
    result = runner.invoke(dataset, "--verifier", "command")
    assert result.exit_code == 0, result.output
    meta = kept(runner)[0]["metadata"]
    assert (meta["reward"], meta["passed"]) == (0.0, False)


def solves_with(command: str):
    def script(request):
        if request.turn == 0:
            return Reply(reasoning="Working.", tool_calls=[("terminal", {"command": command})])
        return Reply(content=f"Ran: {request.tool_results[-1][:200]}", reasoning="Done.")

    return script


def _system_python_offers() -> tuple:
    """What the machine's own Python (the one a local sandbox's commands find) offers the reward-hack corpus."""
    import shutil
    import subprocess

    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if python is None:
        return ()
    has_pytest = subprocess.run([python, "-c", "import pytest"], capture_output=True, cwd="/",
                                env={"PATH": "/usr/bin:/bin"}).returncode == 0
    return ("python3", "pytest") if has_pytest else ("python3",)


class TestLocalVerification(VerifierContract):
    """The verification every backend carries, in the local sandbox: a daemon the session left cannot forge a pass."""

    corpus_offers = _system_python_offers()


def test_the_row_s_test_files_reach_the_sandbox_only_after_the_session(runner, model_server, tmp_path):
    runner.server = model_server(solves_with("ls hidden_test.sh; printf 42 > answer.txt"))
    row = {"prompt": "Do it", "tests": 'sh "$HERMES_TESTS_DIR/hidden_test.sh"',
           "test_files": {"hidden_test.sh": TESTS + ' && test "$(cat "$HERMES_TESTS_DIR/data/expected.txt")" = 42\n',
                          "data/expected.txt": "42"}}
    dataset = write_dataset(tmp_path / "d.jsonl", [row])
    result = runner.invoke(dataset, "--verifier", "command")
    assert result.exit_code == 0, result.output
    record = kept(runner)[0]
    assert "No such file" in record["conversations"][3]["value"]  # the agent did not see it
    assert record["metadata"]["passed"] is True


def test_the_command_verifier_s_own_time_limit_and_bounded_output(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("42"))
    rows = [{"prompt": "Slow", "tests": "sleep 30"}, {"prompt": "Loud", "tests": "yes loud | head -c 100000"}]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, "--verifier", "command:timeout=1,max_output_chars=500")
    assert result.exit_code == 0, result.output
    slow, loud = (json.loads(r["metadata"]["verifiers"])[0] for r in kept(runner))
    assert slow["error"] in ("timed out after 1 s", "TimeoutError: the command ran past its 1 s (command:timeout=...)")
    assert slow["reward"] == 0.0 and slow["duration_s"] < 5
    assert loud["reward"] == 1.0 and len(loud["output"]) < 600 and "characters cut" in loud["output"]


def test_command_run_option_and_a_row_without_tests(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "No tests"}])
    result = runner.invoke(dataset, "--verifier", "command", run_name="none")
    meta = kept(runner, "none")[0]["metadata"]
    assert "no command" in json.loads(meta["verifiers"])[0]["error"] and meta["verified"] is False
    result = runner.invoke(dataset, "--verifier", f"command:run={TESTS}", run_name="given")
    assert result.exit_code == 0, result.output
    assert kept(runner, "given")[0]["metadata"]["passed"] is True


def test_bad_verifier_options_stop_the_run_before_any_model_call(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "x"}])
    result = runner.invoke(dataset, "--verifier", "comand")
    assert result.exit_code != 0 and "did you mean --verifier command?" in result.output
    result = runner.invoke(dataset, "--verifier", "command:timout=3")
    assert result.exit_code != 0 and "did you mean command:timeout=...?" in result.output
    result = runner.invoke(dataset, "--stop_on_success", "--samples_per_prompt", "2")
    assert result.exit_code != 0 and "--stop_on_success needs a verifier" in result.output
    assert runner.server.request_count == 0


def test_the_verified_filter_without_a_verifier_is_refused_before_it_discards_everything(
        runner, model_server, tmp_path):
    """--filter verified with no --verifier would discard every sample ("no verifier ran on it"): the run refuses
    it before any model call, and refilter and export refuse it for a run that ran no verifier."""
    runner.server = model_server(by_sample("42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Write 42", "tests": TESTS}])
    result = runner.invoke(dataset, "--filter", "verified:0.5", "--samples_per_prompt", "2")
    assert result.exit_code == 2 and "--filter verified keeps only samples a verifier passed" in result.output
    assert runner.server.request_count == 0 and not runner.folder().exists()
    assert runner.invoke(dataset).exit_code == 0  # a run without verifiers
    for command in (("refilter", "--filter", "verified"), ("export", "--format", "sharegpt", "--filter", "verified")):
        result = runner.cli(command[0], str(runner.folder()), *command[1:])
        assert result.exit_code == 2 and "ran no --verifier" in result.output, result.output
    assert len(runner.records("trajectories.jsonl")) == 1  # refused: nothing moved


def test_the_verified_filter_discarding_the_failing_samples_is_no_warning_unless_none_passed(
        runner, model_server, tmp_path):
    """Rejection sampling discards most samples by design; only a run where no sample passed gets the warning."""
    runner.server = model_server(by_sample("1", "2", "42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Write 42", "tests": TESTS}])
    args = ("--verifier", "command", "--samples_per_prompt", "3", "--filter", "verified")
    result = runner.invoke(dataset, *args)
    assert result.exit_code == 0 and len(runner.records("discarded.jsonl")) == 2  # 2 of 3: failing samples
    assert "filter discarded" not in result.output
    result = runner.invoke(dataset, *args, "--verifier", "command:run=exit 1", run_name="never")
    assert result.exit_code == 0 and "The verified filter discarded 3 of the 3 finished samples" in result.output
    assert "no sample passed its verifiers" in result.output


def test_the_verifiers_command_lists_them(runner):
    result = runner.cli("verifiers")
    assert result.exit_code == 0, result.output
    for name in ("command", "answer", "judge"):
        assert name in result.output


# --- answer ------------------------------------------------------------------------------------------------


def answer_verdict(spec: str, answer: str, expected, completed: bool = True):
    from hermes_batch.contract.interfaces import VerifierContext
    from hermes_batch.formats.records import PromptRow
    from hermes_batch.run.selection import verifiers
    from hermes_batch.testing.records import make_trajectory

    registry = hermes_batch.get_plugin_manager(load_entry_points=False).registry()
    (verifier,) = verifiers(registry, (spec,))
    row = PromptRow(0, "q", 1, extra={} if expected is None else {"answer": expected})
    ctx = VerifierContext(None, row, make_trajectory(answer=answer, completed=completed), None, lambda *a, **k: None)

    async def verify():
        try:
            return await verifier.verify(ctx)
        finally:
            await verifier.shutdown()  # the regex mode's processes

    return asyncio.run(verify())


@pytest.mark.parametrize("spec, answer, expected, reward", [
    ("answer", "The capital is Paris.\n\n**Paris.**", "paris", 1.0),
    ("answer", "I think it is Lyon.", "Paris", 0.0),
    ("answer", "Let me see.\nThe final answer is: Paris", "Paris", 1.0),
    ("answer", "So x = 42.", 42, 1.0),
    ("answer", "So x = 1,000.", "1000", 1.0),
    ("answer", "Thus \\boxed{3.14159}, approximately.", 3.1416, 0.0),
    ("answer:tolerance=0.001", "Thus \\boxed{3.14159}, approximately.", 3.1416, 1.0),
    ("answer", "no digits here", 7, 0.0),
    ("answer:mode=regex", "The order id is AB-1234.", r"AB-\d{4}", 1.0),
    ("answer:mode=regex", "The order id is AB-12.", r"AB-\d{4}", 0.0),
    ("answer:mode=exact", "42", "42.0", 0.0),
])
def test_the_answer_verifier_compares_the_final_answer(spec, answer, expected, reward):
    assert answer_verdict(spec, answer, expected).reward == reward


def test_answer_mode_number_on_a_row_of_text_and_a_misspelt_mode_say_so():
    with pytest.raises(ValueError, match="the row's `answer` 'Paris' is not a number, so answer:mode=number"):
        answer_verdict("answer:mode=number", "Paris", "Paris")
    with pytest.raises(hermes_batch.HermesBatchError) as caught:
        answer_verdict("answer:mode=nmber", "Paris", "Paris")
    assert str(caught.value) == ("Invalid options for the verifier answer: 'mode' must be in "
                                 "('auto', 'exact', 'number', 'regex') (got 'nmber').")  # not attrs' repr


def test_the_answer_verifier_without_an_answer():
    assert answer_verdict("answer", "x", "x", completed=False).reward == 0.0  # no final answer: fails
    with pytest.raises(ValueError, match="no `answer` field"):  # the row's fault: an error, not a reward
        answer_verdict("answer", "x", None)


# --- judge -------------------------------------------------------------------------------------------------


def test_the_judge_grades_through_the_run_s_client_and_counts_its_calls(runner, model_server, tmp_path):
    def judge(request):
        assert "## Rubric\nSay hello politely." in request.messages[-1]["content"]
        return Reply(content="Polite and correct.\nSCORE: 0.75")

    def route(prompt):
        return judge if prompt.startswith("## Task") else solves("42")

    runner.server = model_server(RoutedScript(route))
    rows = [{"prompt": "Say hello", "rubric": "Say hello politely."}, {"prompt": "No rubric"}]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, "--verifier", "judge", "--min_reward", "0.7")
    assert result.exit_code == 0, result.output
    graded, unrubricked = (r["metadata"] for r in kept(runner))
    assert (graded["reward"], graded["passed"]) == (0.75, True)
    assert json.loads(graded["verifiers"])[0]["reason"] == "Polite and correct. SCORE: 0.75"
    assert len(graded["calls"]) == 3  # two turns of the session and the judge's call
    assert "no rubric" in json.loads(unrubricked["verifiers"])[0]["error"]
    judged = [r for r in runner.server.requests if r.prompt.startswith("## Task")]
    assert len(judged) == 1
    journal = [json.loads(line) for line in (runner.folder() / "calls.jsonl").read_text().splitlines()]
    assert sum(1 for e in journal if e.get("event") == "done") == 5  # 2 + 2 session calls, 1 judge call
    session_tokens = sum(r["metadata"]["usage"]["prompt_tokens"] for r in kept(runner))
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert graded["usage"]["prompt_tokens"] > unrubricked["usage"]["prompt_tokens"]
    assert session_tokens > 0 and stats


JUDGE_KEY = "judge-only-key-7f3a9c21e5"  # in a variable whose name does not look secret: only the option names it


def graded(reply: str, cost=None):
    """A judge script: ``reply`` to every grading request (the preflight probe is answered by the server)."""

    def script(request):
        assert request.prompt.startswith("## Task"), request.prompt
        return Reply(content=reply, usage=hermes_batch.Usage(prompt_tokens=700, completion_tokens=30, cost=cost))

    return script


def test_the_judge_grades_through_another_client_and_endpoint(runner, model_server, tmp_path, monkeypatch):
    """judge:client=anthropic on a second server: the grading goes there in Anthropic's format with the key of
    judge:api_key_env, is journaled and counted in the sample, and the key is in no file of the run."""
    monkeypatch.setenv("GRADER", JUDGE_KEY)
    runner.server = model_server(solves("42"))
    judge = model_server(graded(f"Polite ({JUDGE_KEY}).\nSCORE: 0.8"), api_key=JUDGE_KEY)
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Say hello", "rubric": "Say hello politely."}])
    spec = f"judge:client=anthropic,base_url={judge.anthropic_base_url},api_key_env=GRADER,model=judge-model"
    result = runner.invoke(dataset, "--verifier", spec, "--min_reward", "0.7")
    assert result.exit_code == 0, result.output
    (record,) = kept(runner)
    meta = record["metadata"]
    assert (meta["reward"], meta["passed"]) == (0.8, True)
    grading = [r for r in judge.requests if not r.preflight]
    assert [(r.api, r.model) for r in grading] == [("anthropic", "judge-model")]
    # the judge's server refuses any key but JUDGE_KEY, the agent's any but the run's: each got its own
    assert not [r for r in runner.server.requests if r.prompt.startswith("## Task")]
    assert len(meta["calls"]) == 3 and meta["usage"]["prompt_tokens"] >= 700  # two session turns and the grading
    journal = [json.loads(line) for line in (runner.folder() / "calls.jsonl").read_text().splitlines()]
    assert sum(1 for e in journal if e.get("event") == "done") == 3
    assert any(e.get("event") == "done" and e.get("prompt_tokens") == 700 for e in journal)
    run_json = (runner.folder() / "run.json").read_text()
    assert "api_key_env=GRADER" in run_json  # the variable's name is in run.json, never its value
    for path in runner.folder().rglob("*"):
        if path.is_file():
            assert JUDGE_KEY not in path.read_text(errors="replace"), path
    assert "[REDACTED]" in json.loads(meta["verifiers"])[0]["reason"]


def test_the_judge_s_own_endpoint_counts_in_max_cost(runner, model_server, tmp_path, monkeypatch):
    """Each grading costs $1 on the judge's endpoint (the agent's cost nothing): --max_cost 1.5 stops after two."""
    monkeypatch.setenv("GRADER", JUDGE_KEY)
    runner.server = model_server(solves("42"))
    judge = model_server(graded("Fine.\nSCORE: 1", cost=1.0), api_key=JUDGE_KEY)
    rows = [{"prompt": f"Say hello #{i}", "rubric": "Say hello."} for i in range(4)]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, "--verifier", f"judge:base_url={judge.base_url},api_key_env=GRADER",
                           "--max_cost", "1.5", "--num_workers", "1", "--batch_size", "1")
    assert "--max_cost 1.5 was reached" in result.output, result.output
    records = kept(runner)
    assert len(records) == 2 and [r["metadata"]["usage"]["cost"] for r in records] == [1.0, 1.0]
    assert len([r for r in judge.requests if not r.preflight]) == 2
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["cost"] == 2.0
    result = runner.invoke(dataset, "--verifier", f"judge:base_url={judge.base_url},api_key_env=GRADER",
                           "--max_cost", "100", run_name="roomy")
    assert result.exit_code == 0, result.output
    assert "--max_cost had no effect" not in result.output  # the agent's endpoint reports no cost, the judge's does


def test_a_judge_client_that_is_not_installed_or_cannot_be_reached_stops_the_run_before_any_prompt(
        runner, model_server, tmp_path, monkeypatch):
    runner.server = model_server(solves("42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Say hello", "rubric": "Say hello."}])
    result = runner.invoke(dataset, "--verifier", "judge:client=antropic")
    assert result.exit_code == 2
    assert "No model client 'antropic' is installed" in result.output and "did you mean 'anthropic'?" in result.output
    result = runner.invoke(dataset, "--verifier", "judge:base_url=http://127.0.0.1:9/v1,api_key_env=GRADER")
    assert result.exit_code == 2 and "GRADER named by --verifier judge:api_key_env is not set" in result.output
    monkeypatch.setenv("GRADER", JUDGE_KEY)
    result = runner.invoke(dataset, "--verifier", "judge:base_url=http://127.0.0.1:9/v1,api_key_env=GRADER")
    assert result.exit_code == 2
    assert "The judge's endpoint http://127.0.0.1:9/v1 (openai client) failed its check" in result.output
    assert not [r for r in runner.server.requests if not r.preflight]  # no prompt was paid for
    assert not (runner.folder() / "run.json").exists()


# --- resume --------------------------------------------------------------------------------------------------


def test_a_resume_runs_only_the_samples_not_finished(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("42"))
    rows = [{"prompt": f"Write 42 #{i}", "tests": TESTS} for i in range(2)]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    assert runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "2").exit_code == 0
    before = {row["prompt"]: runner.server.sessions_for(row["prompt"]) for row in rows}
    assert before == {rows[0]["prompt"]: 2, rows[1]["prompt"]: 2}
    result = runner.invoke(dataset, "--resume", "--samples_per_prompt", "3")
    assert result.exit_code == 0, result.output
    assert {row["prompt"]: runner.server.sessions_for(row["prompt"]) for row in rows} == {
        rows[0]["prompt"]: 3, rows[1]["prompt"]: 3}  # one more sample each, none paid twice
    assert [(r["prompt_index"], r["metadata"]["sample_index"]) for r in kept(runner)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert runner.invoke(dataset, "--resume", "--samples_per_prompt", "3").exit_code == 0
    assert runner.server.sessions_for(rows[0]["prompt"]) == 3


def test_a_resume_under_stop_on_success_skips_rows_that_passed(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("1", "42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Write 42", "tests": TESTS}])
    args = ("--verifier", "command", "--stop_on_success")
    assert runner.invoke(dataset, *args, "--samples_per_prompt", "2").exit_code == 0
    assert [r["metadata"]["passed"] for r in kept(runner)] == [False, True]
    assert runner.invoke(dataset, "--resume", *args, "--samples_per_prompt", "6").exit_code == 0
    assert runner.server.sessions_for("Write 42") == 2 and len(kept(runner)) == 2


def test_a_resume_takes_the_run_s_verifier_for_stop_on_success_and_the_verified_filter(
        runner, model_server, tmp_path):
    """--verifier is the run's on a resume (run.json), so --stop_on_success and --filter verified need not repeat it."""
    runner.server = model_server(by_sample("1", "2", "42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Write 42", "tests": TESTS}])
    assert runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "2").exit_code == 0
    result = runner.invoke(dataset, "--resume", "--stop_on_success", "--samples_per_prompt", "4",
                           "--filter", "verified", "--allow_changed_settings")
    assert result.exit_code == 0, result.output
    assert [r["metadata"]["passed"] for r in kept(runner)] == [False, False, True]  # stopped at the third
    assert runner.server.sessions_for("Write 42") == 3


def test_a_run_folder_from_before_samples_resumes_as_before(runner, model_server, tmp_path):
    """Sample 0's key is the row's content key: records without sample_index count as sample 0."""
    from hermes_batch.formats.records import content_key

    runner.server = model_server(by_sample("42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Old"}, {"prompt": "New"}])
    assert runner.invoke(dataset, "--max_samples", "1").exit_code == 0
    record = runner.records("trajectories.jsonl")[0]
    assert record["metadata"]["content_key"] == content_key("Old", None, None)
    for name in ("sample_index", "reward", "verified", "passed", "verifiers"):  # as an older version wrote it
        del record["metadata"][name]
    (runner.folder() / "batch_0.jsonl").write_text(json.dumps(record) + "\n")
    shutil.rmtree(runner.folder() / "index", ignore_errors=True)  # rebuilt from the records, as for an old folder
    result = runner.invoke(dataset, "--resume", "--max_samples", "2")
    assert result.exit_code == 0, result.output
    assert runner.server.sessions_for("Old") == 1 and runner.server.sessions_for("New") == 1
    result = runner.invoke(dataset, "--resume", "--max_samples", "4", "--samples_per_prompt", "2")
    assert result.exit_code == 0, result.output
    assert runner.server.sessions_for("Old") == 2 and runner.server.sessions_for("New") == 2  # sample 1 of each


def test_a_sample_killed_during_its_verification_runs_again_whole_and_nothing_finished_is_paid_twice(
        runner, model_server, tmp_path, procs):
    """SIGKILL between a session's end and its verification: the sample's record is written only once it is
    verified, so the resume runs that sample again, session and all, its answers replayed (docs/verification.md
    says so); the samples recorded before are not run again."""
    import os
    import signal

    from hermes_batch.testing import wait_for

    def script(request):  # the third session leaves a file that makes its tests hang
        command = "touch slow" if request.sample == 2 else "true"
        return solves_with(command)(request)

    runner.server = model_server(script)
    prompt = "Kill me while verifying"
    # the third sample's tests say that they started, then wait (at most 2 minutes) until the test opens the gate,
    # which it does before the resume, so that the resume's verification of that sample passes at once
    gate = tmp_path / "gate"
    gate.mkdir()
    gate.chmod(0o777)  # as root the commands run as a user of their own
    tests = (f"if [ -f slow ]; then touch {gate}/verifying; "
             f"for i in $(seq 1200); do [ -e {gate}/open ] && break; sleep 0.1; done; fi; true")
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": prompt, "tests": tests}])
    proc = runner.spawn(dataset, "--verifier", "command", "--samples_per_prompt", "4", "--num_workers", "1",
                        "-S", f"expose={gate}:rw", start_new_session=True)
    procs.append(proc)
    batch = runner.folder() / "batch_0.jsonl"

    wait_for((gate / "verifying").exists, 120, "the third sample's verification", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert batch.read_text().count("\n") == 2  # two samples recorded, the third's session over
    assert runner.server.sessions_for(prompt) == 3 and runner.server.calls_for(prompt) == 6
    (gate / "open").touch()
    result = runner.invoke(dataset, "--resume")
    assert result.exit_code == 0, result.output
    assert [r["metadata"]["sample_index"] for r in kept(runner)] == [0, 1, 2, 3]
    assert all(r["metadata"]["passed"] for r in kept(runner))
    # samples 0 and 1 were not run again; sample 2 was, whole, its two answers replayed from responses.jsonl
    assert runner.server.sessions_for(prompt) == 4
    assert runner.server.calls_for(prompt) == 8
    assert [r["metadata"]["replayed_turns"] for r in kept(runner)] == [0, 0, 2, 0]


def test_samples_follow_their_row_when_the_dataset_changes(runner, model_server, tmp_path):
    """A resume over an edited dataset renumbers every sample of a row with the row, none set aside."""
    runner.server = model_server(by_sample("42"))
    rows = [{"prompt": "Row A", "tests": TESTS}, {"prompt": "Row B", "tests": TESTS}]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    assert runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "2").exit_code == 0
    write_dataset(dataset, [{"prompt": "Row new", "tests": TESTS}, *rows])
    result = runner.invoke(dataset, "--resume")
    assert result.exit_code == 0, result.output
    assert not (runner.folder() / "unmatched.jsonl").exists() or not runner.records("unmatched.jsonl")
    placed = [(r["conversations"][1]["value"], r["prompt_index"], r["metadata"]["sample_index"]) for r in kept(runner)]
    assert placed == [("Row new", 0, 0), ("Row new", 0, 1), ("Row A", 1, 0), ("Row A", 1, 1),
                      ("Row B", 2, 0), ("Row B", 2, 1)]
    assert [runner.server.sessions_for(p) for p in ("Row new", "Row A", "Row B")] == [2, 2, 2]


def test_the_verifier_written_in_the_docs_works(runner, model_server, tmp_path):
    import re
    import types
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "verification.md").read_text()
    block = re.search(r"```python\n(.*?)```", doc.split("## Writing a verifier", 1)[1], re.S).group(1)
    plugin = types.ModuleType("docs_verifier")
    exec(compile(block, "docs/verification.md", "exec"), plugin.__dict__)
    runner.plugins = (plugin,)
    runner.server = model_server(solves_with("touch made.txt"))
    rows = [{"prompt": "Make it", "expect_file": "made.txt"}, {"prompt": "Make another", "expect_file": "other.txt"}]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, "--verifier", "file-exists")
    assert result.exit_code == 0, result.output
    assert [r["metadata"]["passed"] for r in kept(runner)] == [True, False]


@pytest.mark.parametrize("stop", [False, True], ids=["side-by-side", "stop_on_success"])
def test_max_cost_counts_samples_and_a_resume_runs_the_rest(runner, model_server, tmp_path, stop):
    from hermes_batch import Usage

    def costly(request):
        reply = solves("41")(request)  # never passes
        return attrs.evolve(reply, usage=Usage(prompt_tokens=10, completion_tokens=5, cost=0.01))

    runner.server = model_server(costly)
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Costly", "tests": TESTS}])
    args = ["--verifier", "command", "--samples_per_prompt", "6", "--num_workers", "1"] + (["--stop_on_success"] if stop else [])
    result = runner.invoke(dataset, *args, "--max_cost", "0.05")
    assert result.exit_code == 0, result.output
    assert "budget" in result.output
    assert len(kept(runner)) == 3  # 0.02 a sample: the third reaches 0.05, no fourth is started
    result = runner.invoke(dataset, "--resume", *args, "--max_cost", "1")
    assert result.exit_code == 0, result.output
    assert [r["metadata"]["sample_index"] for r in kept(runner)] == [0, 1, 2, 3, 4, 5]
    assert runner.server.sessions_for("Costly") == 6
