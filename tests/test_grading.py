"""The building blocks of a verifier's tests run apart from the agent (hermes_batch.grading), and the local
sandbox's use of them: the hidden files, the tests' environment, the dataset no sandbox shows."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from hermes_batch import grading
from hermes_batch.testing import Reply, write_dataset


def test_hidden_files_are_written_exactly_into_the_tests_folder_and_nowhere_else(tmp_path):
    files = grading.checked_files({
        "check.sh": "echo 'it''s' \"$HOME\" `id` $(id)\n",
        "data/deep/er.txt": "no newline at the end",
        "unicode.txt": "ünïcödé ✓ 🧪\n",
        "empty": "",
        "./dotted/../x.txt": "normalised",
    })
    tests_dir, workdir = tmp_path / "tests", tmp_path / "work dir"
    tests_dir.mkdir()
    workdir.mkdir()
    script = grading.tests_script("pwd > where; echo ran", files, str(workdir))
    done = subprocess.run(["/bin/sh", "-c", script], env={"HERMES_TESTS_DIR": str(tests_dir), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ran\n"
    assert (tests_dir / "check.sh").read_text() == "echo 'it''s' \"$HOME\" `id` $(id)\n"
    assert (tests_dir / "data/deep/er.txt").read_text() == "no newline at the end"
    assert (tests_dir / "unicode.txt").read_text() == "ünïcödé ✓ 🧪\n"
    assert (tests_dir / "empty").read_text() == ""
    assert (tests_dir / "x.txt").read_text() == "normalised"
    assert (workdir / "where").read_text().strip() == str(workdir)  # the command runs in the working folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tests", "work dir"]


@pytest.mark.parametrize("files, why", [
    ({"/etc/passwd": "x"}, "paths must be relative"),
    ({"../up.txt": "x"}, "paths must be relative"),
    ({"a/../../up.txt": "x"}, "paths must be relative"),
    ({"": "x"}, "paths must be relative"),
    ({"nul\0.txt": "x"}, "paths must be relative"),
    ({"a.txt": "with\0nul"}, "without NUL"),
    ({"a.txt": 3}, "object of path -> file content"),
    (["a.txt"], "object of path -> file content"),
])
def test_hidden_files_that_could_leave_the_tests_folder_are_refused(files, why):
    with pytest.raises(ValueError, match=why):
        grading.checked_files(files)


def test_the_tests_environment_has_no_start_up_hook_and_no_path_of_the_agent():
    env = grading.tests_environment(
        "/work/bin:.:/usr/local/bin::relative/bin:/home/agent/.local/bin:/usr/bin:/tmp/bin:/bin",
        ("/work", "/home/agent", "/tmp"),
        {"BASH_ENV": "/home/agent/.bashrc", "ENV": "/home/agent/.shrc", "PYTHONPATH": "/work",
         "LD_PRELOAD": "/work/x.so", "PYTEST_ADDOPTS": "-p evil", "HERMES_REWARD_FILE": "/work/r",
         "BASH_FUNC_cd%%": "() { :; }", "TASK_SETTING": "kept"},
    )
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert env["TASK_SETTING"] == "kept"
    for name in ("BASH_ENV", "ENV", "PYTHONPATH", "LD_PRELOAD", "PYTEST_ADDOPTS", "HERMES_REWARD_FILE", "BASH_FUNC_cd%%"):
        assert name not in env
    assert (env["PYTHONNOUSERSITE"], env["PYTHONSAFEPATH"]) == ("1", "1")
    assert grading.tests_environment(None)["PATH"] == grading.STANDARD_PATH


@pytest.mark.parametrize("hex_text, reward, problem", [
    ("6e", None, ""),
    ((b"f" + b"0.5\n").hex(), b"0.5\n", ""),
    ((b"b" + b"a symbolic link").hex(), None, "the reward file cannot be read (a symbolic link)"),
    ("zz", None, "the tests' supervisor gave no readable report"),
    ("", None, "the tests' supervisor gave no readable report"),
])
def test_the_supervisor_s_report_is_read(hex_text, reward, problem):
    assert grading.read_report(hex_text) == (reward, problem)


def test_only_the_last_report_line_counts():
    text = "hermes-batch-reward 6e\nnoise\nhermes-batch-reward " + (b"f1").hex() + "\n"
    assert grading.report_in(text) == (b"f1").hex()
    assert grading.report_in("nothing here") is None


# --- the local sandbox ---------------------------------------------------------------------------------------

def reads(command: str):
    def script(request):
        if request.turn == 0:
            return Reply(reasoning="Looking.", tool_calls=[("terminal", {"command": command})])
        return Reply(content="Done.", reasoning="Done.")

    return script


def test_no_local_sandbox_shows_the_dataset_with_its_tests(runner, model_server, tmp_path):
    dataset = tmp_path / "public" / "d.jsonl"
    dataset.parent.mkdir()
    dataset.parent.chmod(0o755)
    row = {"prompt": "Find the tests", "tests": "echo SECRET-TEST-MARKER; true", "answer": "SECRET-ANSWER-MARKER"}
    write_dataset(dataset, [row])
    dataset.chmod(0o644)
    runner.server = model_server(reads(f"cat {dataset}; ls -la {dataset.parent}; grep -r SECRET- {dataset.parent}"))
    # the dataset's folder is shown (its private /tmp would hide it anyway): the dataset in it is not
    result = runner.invoke(dataset, "--verifier", "command", "-S", "isolation=namespace",
                           "-S", f"expose={dataset.parent}")
    assert result.exit_code == 0, result.output
    record = runner.records("trajectories.jsonl")[0]
    seen = record["conversations"][3]["value"]
    assert "Permission denied" in seen  # the file is there, covered
    assert "SECRET-" not in seen
    assert record["metadata"]["passed"] is True


def test_a_sandbox_that_cannot_keep_the_tests_apart_is_refused_unless_asked(runner, model_server, tmp_path):
    runner.server = model_server(reads("echo 1 > .hermes_batch_reward"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Cheat", "tests": "true"}])
    refused = runner.invoke(dataset, "--verifier", "command", "-S", "isolation=process")
    assert refused.exit_code == 2
    assert "--verifier command cannot keep the tests apart" in refused.output
    assert "command:apart=false" in refused.output
    assert not runner.server.calls_for("Cheat")  # refused before any model call
    ran = runner.invoke(dataset, "--verifier", "command:apart=false", "-S", "isolation=process")
    assert ran.exit_code == 0, ran.output
    meta = runner.records("trajectories.jsonl")[0]["metadata"]
    assert (meta["reward"], meta["passed"]) == (1.0, True)
    assert json.loads(meta["verifiers"])[0]["reason"] == "exit status 0 (in the agent's context: command:apart=false)"


def test_the_documented_rows_grade_an_honest_solution_1_and_a_wrong_one_0(runner, model_server, tmp_path):
    from pathlib import Path
    import re

    from hermes_batch.testing import RoutedScript

    doc = (Path(__file__).resolve().parents[1] / "docs" / "verification.md").read_text()
    section = doc.split("### Tests apart from the agent")[1].split("\n### ")[0]
    block = re.findall(r"```json\n(.*?)```", section, re.S)[0]
    rows = [json.loads(line) for line in block.splitlines() if line.strip()]
    solutions = {
        "rev": ("printf 'echo \"$1\"\\n' > rev.sh",  # wrong, then right
                "printf '%s\\n' 'echo \"$1\" | awk '\\''{for (i = length; i > 0; i--) printf \"%s\", substr($0, i, 1); print \"\"}'\\''' > rev.sh"),
        "double": ("printf 'echo $(( $1 + 2 ))\\n' > double.sh", "printf 'echo $(( $1 * 2 ))\\n' > double.sh"),
    }
    by_prompt = {row["prompt"]: row["id"] for row in rows}

    def script(request):
        if request.turn == 0:
            command = solutions[by_prompt[request.prompt]][request.sample]
            return Reply(reasoning="Writing it.", tool_calls=[("terminal", {"command": command})])
        return Reply(content="Done.", reasoning="Written.")

    runner.server = model_server(RoutedScript(lambda sample: script, by="sample"))
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "2")
    assert result.exit_code == 0, result.output
    records = runner.records("trajectories.jsonl") + [d["trajectory"] for d in runner.records("discarded.jsonl")]
    rewards = sorted((r["metadata"]["id"], r["metadata"]["sample_index"], r["metadata"]["reward"]) for r in records)
    # the wrong double.sh passes one case of three (2 + 2 == 2 * 2)
    assert rewards == [("double", 0, pytest.approx(1 / 3, abs=1e-5)), ("double", 1, 1.0), ("rev", 0, 0.0), ("rev", 1, 1.0)]


def test_clean_grading_keeps_only_the_working_folder_and_flags_a_disagreement(runner, model_server, tmp_path):
    # Row "outside" passes in place only through a file the agent left outside its working folder (in its home);
    # row "inside" passes both ways; row "modes" made its folder unreadable and still passes in a fresh sandbox.
    commands = {
        "outside": "printf 'hello\\n' > ../lib.txt; printf 'cat ../lib.txt\\n' > say.sh",
        "inside": "printf 'echo hello\\n' > say.sh",
        "modes": "printf 'echo hello\\n' > say.sh; mkdir -p deep/er; printf x > deep/er/f; chmod 000 deep/er/f deep/er; "
                 "mkfifo pipe; ln -s /etc/passwd link; chmod 555 .",
    }
    runner.server = model_server(RoutedPrompt(commands))
    rows = [{"prompt": name, "cwd": "work", "tests": 'test "$("$HERMES_RUN_UNTRUSTED" sh say.sh)" = hello'}
            for name in commands]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, "--verifier", "command:clean=true")
    assert result.exit_code == 0, result.output
    entries = {r["conversations"][1]["value"]: json.loads(r["metadata"]["verifiers"])[0]
               for r in runner.records("trajectories.jsonl") + [d["trajectory"] for d in runner.records("discarded.jsonl")]}
    assert (entries["outside"]["reward"], entries["outside"]["disagree"]) == (0.0, True)
    assert entries["outside"]["reason"].startswith("clean: exit status 1; in place: exit status 0")
    assert (entries["inside"]["reward"], entries["inside"]["disagree"]) == (1.0, False)
    assert (entries["modes"]["reward"], entries["modes"]["disagree"]) == (1.0, False), entries["modes"]


def test_clean_grading_is_refused_where_the_backend_cannot_copy_a_folder(runner, model_server, tmp_path):
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "p", "tests": "true"}])
    runner.server = model_server(RoutedPrompt({"p": "true"}))
    refused = runner.invoke(dataset, "--verifier", "command:clean=true,apart=false")
    assert refused.exit_code == 2
    assert "drop apart=false" in refused.output


class RoutedPrompt:
    """Each prompt's one command, then a final answer."""

    def __init__(self, commands: dict):
        self.commands = commands

    def __call__(self, request):
        if request.turn == 0:
            return Reply(reasoning="Working.", tool_calls=[("terminal", {"command": self.commands[request.prompt]})])
        return Reply(content="Done.", reasoning="Done.")
