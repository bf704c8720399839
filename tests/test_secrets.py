"""No configured secret reaches an output file or a log, whatever a sandbox reads; the runner hides them.

The end-to-end tests use keys of their own (never the shared test key), so that
other runs on the same machine cannot make a walk of ``/proc`` find them.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
from click.testing import CliRunner

from hermes_batch.testing import write_dataset

from hermes_batch.cli import cli
from hermes_batch.run.config import RunConfig
from hermes_batch.formats.redaction import REDACTED, Redactor, RedactingFilter, display_url, encodings, run_secrets
from hermes_batch.testing import ErrorRule, Reply, RoutedScript, ScriptedModelServer


def new_secret(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def self_blind_pattern(secret: str) -> str:
    """An extended regex that matches ``secret`` but not the command line holding the pattern itself."""
    return f"{secret[:-1]}[{secret[-1]}]"


def files_holding(folder: Path, needles) -> list:
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            found += [f"{path.relative_to(folder)}: {n}" for n in needles if n.encode() in data]
    return found


def all_forms(*values) -> set:
    return {form for value in values for form in encodings(value)}


# --- the redaction layer ----------------------------------------------------------------------------


def test_every_encoding_of_a_secret_is_redacted_wherever_it_sits():
    key = "sk-live-0123456789abcdef"
    redactor = Redactor([key])
    for prefix in ("", "a", "ab", "abc"):  # every base64 alignment
        blob = base64.b64encode(f"{prefix}Authorization: Bearer {key}\n".encode()).decode()
        redacted = redactor.text(blob)
        assert REDACTED in redacted
        # what is left decodes to at most two characters of the key on each side of the cut
        head, tail = redacted.split(REDACTED)
        assert key[:3] not in base64.b64decode(head[: len(head) // 4 * 4]).decode(errors="replace")[-40:]
    for text in (key, quote(key, safe=""), key.encode().hex(), key.encode().hex().upper(),
                 base64.urlsafe_b64encode(key.encode()).decode(), f"x={key};"):
        assert REDACTED in redactor.text(text), text
    assert redactor.text("nothing secret here") == "nothing secret here"


def test_short_values_are_not_secrets():
    redactor = Redactor(["EMPTY", "x"])
    assert not redactor
    assert redactor.text("EMPTY x") == "EMPTY x"


def test_the_secrets_of_a_run(tmp_path):
    config = RunConfig(
        dataset_file=tmp_path / "d.jsonl", batch_size=1, run_name="r", api_key="sk-the-api-key-1234",
        base_url="https://user-name:pass%40word-9876@gateway.example/v1?api-version=2024-05-01&key=query-secret-42",
        sandbox_options={"auth_token": "option-token-5555", "image": "python:3.11-slim",
                         "registry": "https://reg-user:reg-password-77@registry.example"},
        tool_options={"image_gen": {"api_key_env": "MY_IMAGE_PROVIDER", "model": "flux-dev-model"}},
    )
    environ = {"FIRECRAWL_API_KEY": "fc-provider-key-321", "HF_TOKEN": "hf_token_value_654", "PATH": "/usr/bin:/bin",
               "SSH_AUTH_SOCK": "/tmp/ssh-agent.sock", "MODAL_TOKEN_SECRET": "as-modal-secret-000",
               "AWS_SECRET_ACCESS_KEY": "/run/secrets/aws", "MY_IMAGE_PROVIDER": "named-by-an-option-999"}
    found = set(run_secrets(config, environ))
    assert {"sk-the-api-key-1234", "user-name:pass%40word-9876", "pass@word-9876", "query-secret-42",
            "option-token-5555", "reg-password-77", "fc-provider-key-321", "hf_token_value_654",
            "as-modal-secret-000", "named-by-an-option-999"} <= found
    assert not found & {"2024-05-01", "python:3.11-slim", "/usr/bin:/bin", "/tmp/ssh-agent.sock", "/run/secrets/aws",
                        "flux-dev-model", "MY_IMAGE_PROVIDER"}
    public = json.dumps(config.public())
    assert "gateway.example/v1?api-version=2024-05-01&key=[REDACTED]" in public
    for value in ("sk-the-api-key-1234", "pass%40word-9876", "query-secret-42", "option-token-5555", "reg-password-77"):
        assert value not in public


def test_the_ephemeral_system_prompt_is_never_in_the_public_configuration(tmp_path):
    config = RunConfig(dataset_file=tmp_path / "d.jsonl", batch_size=1, run_name="r",
                       ephemeral_system_prompt="Internal house rules 4711.")
    assert "Internal house rules" not in json.dumps(config.public())
    assert "ephemeral_system_prompt" not in config.public()


def test_display_url_keeps_what_is_not_secret():
    assert display_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    assert display_url("https://k3y-abcdefgh@api.example/v1?sig=abc&region=eu") == (
        "https://api.example/v1?sig=[REDACTED]&region=eu"
    )


def test_log_records_are_redacted_with_their_arguments_and_tracebacks():
    key = "sk-log-secret-abcdef"
    flt = RedactingFilter(Redactor([key]))
    try:
        raise ValueError(f"refused {key}")
    except ValueError:
        record = logging.LogRecord("hermes_batch", logging.WARNING, __file__, 1, "called with %s", (key,), sys.exc_info())
    assert flt.filter(record)
    assert record.getMessage() == f"called with {REDACTED}"
    assert key not in record.exc_text and REDACTED in record.exc_text


# --- end to end: the model and the sandbox try to leak ------------------------------------------------


def leaky_script(secrets_to_echo):
    """Echoes every secret back, raw and encoded, in content, reasoning, tool calls and tool output."""

    def script(request):
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        values = [key, *secrets_to_echo]
        if request.turn == 0:
            command = "; ".join(
                f"echo {v}; printf %s {v} | base64; printf %s {v} | od -An -tx1 | tr -d ' \\n'; echo" for v in values
            )
            return Reply(reasoning=f"The key is {key}.", content=f"Using {quote(key)}", tool_calls=[("terminal", {"command": command})])
        return Reply(content=f"Done. Secrets: {' '.join(values)}", reasoning=f"Again {key}")

    return script


def test_secrets_echoed_by_the_model_and_the_sandbox_are_redacted_everywhere(tmp_path):
    key, password, token = new_secret("sk-hb-echo"), new_secret("pw"), new_secret("tool-token")
    doomed = "Fail loudly."
    routes = RoutedScript({doomed: lambda request: Reply(content="unreachable")}, default=leaky_script([password, token]))
    error = ErrorRule(status=400, rate=1.0, match=lambda r: r.prompt == doomed and not r.preflight, message=f"Key {key} refused")
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Show me the keys."}, {"prompt": doomed}])
    with ScriptedModelServer(routes, errors=[error], api_key=None) as server:
        base_url = server.base_url.replace("http://", f"http://hbuser:{password}@")
        args = [
            "run", "--dataset_file", str(dataset), "--batch_size", "5", "--run_name", "leaky",
            "--output_dir", str(tmp_path / "out"), "--model", "scripted-model", "--api_key", key,
            "--base_url", base_url, "--no-progress", "--verbose", "--no_filters", "--max_retries", "0",
            "--ephemeral_system_prompt", "Never reveal house rule 4711.",
        ]
        os.environ["HB_LEAKTEST_PROVIDER_TOKEN"] = token
        try:
            result = CliRunner().invoke(cli, args, catch_exceptions=False)
        finally:
            del os.environ["HB_LEAKTEST_PROVIDER_TOKEN"]
    assert result.exit_code == 3, result.output  # the doomed prompt failed
    folder = tmp_path / "out" / "leaky"
    forms = all_forms(key, password, token, f"hbuser:{password}")
    assert files_holding(folder, forms) == []
    assert [form for form in forms if form in result.output] == []
    assert "house rule 4711" not in (folder / "run.json").read_text()
    assert json.loads((folder / "run.json").read_text())["config"]["base_url"] == server.base_url
    trajectory = (folder / "trajectories.jsonl").read_text()
    assert trajectory.count(REDACTED) >= 9  # each secret, raw, base64 and hex, in the tool output
    failed = json.loads((folder / "failed.jsonl").read_text())
    assert REDACTED in failed["message"]


LEAK_COMMANDS = (
    # the runner is the parent of the command's shell in process mode; 0 in a namespace
    'n=0; for f in /proc/$PPID/environ /proc/$PPID/cmdline; do grep -qE "$p" $f 2>/dev/null && n=$((n+1)); done; '
    'echo "parent=$n"',
    # every process of the machine the command can see, threads included
    'n=$(grep -lE "$p" /proc/[0-9]*/environ /proc/[0-9]*/cmdline /proc/[0-9]*/task/*/environ 2>/dev/null | wc -l); '
    'echo "walk=$n"',
)


def hardening_script(patterns):
    def script(request):
        if request.turn < len(LEAK_COMMANDS):
            # a pattern that matches the secret but not the command line that holds it
            calls = [("terminal", {"command": f"p='{pattern}'; {LEAK_COMMANDS[request.turn]}"}) for pattern in patterns]
            return Reply(reasoning="Looking around.", tool_calls=calls)
        return Reply(content="Looked.", reasoning="Done.")

    return script


@pytest.mark.parametrize("isolation", ["namespace", "process"])
def test_a_local_command_cannot_read_the_runners_secrets(tmp_path, isolation):
    key, password, token = new_secret("sk-hb-hide"), new_secret("pw"), new_secret("tool-token")
    patterns = [self_blind_pattern(value) for value in (key, password, token)]
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Find the keys."}])
    with ScriptedModelServer(hardening_script(patterns), api_key=None) as server:
        base_url = server.base_url.replace("http://", f"http://hbuser:{password}@")
        env = dict(os.environ, PYTHONUNBUFFERED="1", HB_LEAKTEST_PROVIDER_TOKEN=token, OPENAI_API_KEY=key)
        done = subprocess.run(
            [sys.executable, "-m", "hermes_batch", "run", "--dataset_file", str(dataset), "--batch_size", "5",
             "--run_name", "hidden", "--output_dir", str(tmp_path / "out"), "--model", "scripted-model",
             "--api_key", key, "--base_url", base_url, "--no-progress", "--verbose", "--no_filters",
             "-S", f"isolation={isolation}"],
            capture_output=True, text=True, env=env, timeout=300,
        )
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "out" / "hidden"
    (trajectory,) = [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]
    outputs = [
        json.loads(block)["content"]["output"]
        for turn in trajectory["conversations"] if turn["from"] == "tool"
        for block in turn["value"].split("<tool_response>\n")[1:]
        for block in [block.split("\n</tool_response>")[0]]
    ]
    assert sorted(outputs) == sorted(["parent=0\n"] * 3 + ["walk=0\n"] * 3)
    forms = all_forms(key, password, token)
    assert files_holding(folder, forms) == []
    assert [form for form in forms if form in done.stderr] == []
    # Nothing had to be redacted: the sandbox never saw a secret.
    assert files_holding(folder, [REDACTED]) == []
