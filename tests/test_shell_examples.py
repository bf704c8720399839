"""Every shell example of the README, docs/ and the plugins' READMEs works when pasted, as datasette and llm check theirs.

Each ```bash / ```sh / ```shell / ```console block (and each inline `pip install ...`)
is read command by command, continuation lines joined, and every command is checked
without running anything long or outside a scratch folder:

* ``hermes-batch ...`` is parsed by the real click command (options, required
  options, choices); ``run`` goes on to build its RunConfig and to select its
  sandbox, executor, filters, writers, distribution and ``-T`` toolset options
  with the installed plugins, as the run would before its first model call;
  ``export`` and ``refilter`` their formats and filters.  A ``...`` stands for the
  required options the example leaves out.  ``new-plugin`` runs, in a scratch folder.
* ``pip install`` names only folders of this checkout (nothing is on a package
  index yet), each with a pyproject.toml and the extras asked for, and a plugin of
  the checkout comes with the core (``.``) in the same command.
* ``scripts/*.sh`` exist, are executable and take the argument given (their ``case``);
  ``python FILE ...`` runs a file that exists and takes the options given (its
  ``--help``); ``python -m pytest PATH`` names paths that exist.
* ``ray`` and ``modal`` are parsed by their own click commands; ``cd`` goes to a
  folder of the checkout or one an earlier command made; the rest is in OTHERS
  with the reason it is not checked further.

A failure names the file, the line and the command, and says why.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Optional

import attrs
import click
import pytest
from click.testing import CliRunner

from hermes_batch.contract import plugins
from hermes_batch.run import selection
from hermes_batch.cli import cli
from hermes_batch.cli import run as run_cli
from hermes_batch.run.config import model_settings
from hermes_batch.errors import HermesBatchError
from hermes_batch.offline.export import parse_splits
from hermes_batch.contract.toolsets import build_runtimes

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted(REPO.glob("hermes_batch_*/README.md")), *sorted(REPO.glob("plugins/*/README.md"))]
SHELL = ("bash", "sh", "shell", "console")

# Commands of the documents that are not examples, and why: (document, command as written) -> reason.
NOT_EXAMPLES = {
    ("README.md", "pip install ./hermes_batch_docker"): "the README shows it as the command that fails",
}
# Programs whose commands are not checked further, and why.
OTHERS = {
    "export": "sets a variable for the commands after it",
    "pytest": "runs the tests of the folder it is in (tests/test_plugin_kit.py runs those of a new plugin)",
}
# Other programs with a click command line: parsed by it, never run.
CLICK_PROGRAMS = {"ray": "ray.scripts.scripts:cli", "modal": "modal.cli.entry_point:entrypoint_cli"}
# What `...` in a hermes-batch example stands for: the required options, when the example leaves them out.
REQUIRED = {"run": {"--dataset_file": "prompts.jsonl", "--batch_size": "10", "--run_name": "example"}}
PLACEHOLDER = "..."


@attrs.frozen
class Command:
    words: tuple[str, ...]
    document: Path
    line: int
    text: str  # as written, continuation lines joined

    def where(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}: `{self.text}`"


@attrs.frozen
class Block:
    document: Path
    line: int  # of the opening fence (or of the inline span)
    commands: tuple[Command, ...]
    problems: tuple[str, ...] = ()  # found while reading it

    @property
    def id(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}"


_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_INLINE = re.compile(r"`((?:\.venv/bin/)?pip3? install [^`]+)`")
_SHELL_LOOKING = re.compile(r"^\s*(\$ )?(\.venv/bin/|scripts/|hermes-batch |pip3? install |python3? )")


def read_blocks(document: Path, text: Optional[str] = None) -> list[Block]:
    """The shell examples of a Markdown document: fenced shell blocks and inline `pip install` spans."""
    lines = (document.read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            for span in _INLINE.finditer(lines[i]):
                blocks.append(Block(document, i + 1, tuple(_commands(document, [(i + 1, span.group(1))]))))
            if lines[i].startswith("    ") and _SHELL_LOOKING.match(lines[i]) and (i == 0 or not lines[i - 1].strip()):
                blocks.append(Block(document, i + 1, (), (
                    f"{document.relative_to(REPO)}:{i + 1}: an indented code block is not checked; fence it with ```bash",)))
            i += 1
            continue
        indent, marker, lang = fence.groups()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(marker[:3]):
            body.append((i + 1, lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip()))
            i += 1
        i += 1
        if lang in SHELL:
            if lang == "console":  # only the lines after a prompt are commands
                body = [(n, line[2:]) for n, line in body if line.startswith("$ ")]
            blocks.append(Block(document, start, tuple(_commands(document, body))))
        elif not lang and any(_SHELL_LOOKING.match(line) for _n, line in body):
            blocks.append(Block(document, start, (), (
                f"{document.relative_to(REPO)}:{start}: a block of shell commands without a language is not checked; "
                "open it with ```bash",)))
    return blocks


def _commands(document: Path, body: list[tuple[int, str]]) -> list[Command]:
    """The commands of a block's lines: continuation lines joined, comments dropped, split at ; && || |."""
    found, pending, first = [], "", 0
    for number, line in body:
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined = (pending + line).strip()
        pending = ""
        lexer = shlex.shlex(joined, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        try:
            tokens = list(lexer)
        except ValueError as exc:  # an unclosed quote
            found.append(Command((), document, first, joined.split(" #")[0].strip() + f"  <- {exc}"))
            continue
        for token in [*tokens, ";"]:
            if token in (";", "&&", "||", "|", "&"):
                if words:
                    found.append(Command(tuple(words), document, first, " ".join(words)))
                words = []
            else:
                words.append(token)
    return found


# --- checks: each returns the problem, or None ---------------------------------------------------------


class Shell:
    """The state of one block as its commands would leave it: the working folder and the folders they made."""

    def __init__(self, scratch: Path):
        self.cwd = REPO
        self.scratch = scratch
        self.made: dict[str, Path] = {}

    def path(self, name: str) -> Path:
        here = (self.cwd / name).resolve()
        if here.exists() or name.split("/")[0] not in self.made:
            return here
        return (self.made[name.split("/")[0]] / "/".join(name.split("/")[1:])).resolve()


def check(command: Command, shell: Shell) -> Optional[str]:
    if (command.document.relative_to(REPO).as_posix(), command.text) in NOT_EXAMPLES:
        return None
    words = list(command.words)
    if not words:
        return "cannot be read as a shell command"
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value before a command
        words.pop(0)
    if not words:
        return None
    program = words[0]
    name = Path(program).name
    if name == "hermes-batch":
        return check_hermes_batch(words[1:], shell)
    if name in ("python", "python3") or re.fullmatch(r"python3\.\d+", name):
        if words[1:3] == ["-m", "hermes_batch"]:
            return check_hermes_batch(words[3:], shell)
        return check_python(words[1:], shell)
    if name in ("pip", "pip3"):
        return check_pip(words[1:], shell)
    if program.startswith("scripts/"):
        return check_script(program, words[1:], shell)
    if name == "cd":
        return check_cd(words[1:], shell)
    if program in (".", "source"):
        return check_activate(words[1:], shell)
    if name in CLICK_PROGRAMS:
        return check_click_program(name, words[1:])
    if name in OTHERS:
        return None
    return (f"runs {program!r}, which this test does not know; check it in tests/test_shell_examples.py "
            "or add it to OTHERS with the reason it needs no check")


def _parse(command: click.Command, prog: str, args: list[str], obj=None) -> click.Context:
    """Parse ``args`` as ``prog`` would, down to the last subcommand, running nothing; raises click's errors."""
    ctx = command.make_context(prog, list(args), obj=obj)
    while isinstance(command, click.Group):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # click 8.2 keeps the subcommand in protected_args
            rest = [*ctx.protected_args, *ctx.args]
        if not rest:
            break
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
    return ctx


def _complete(args: list[str], shell: Shell) -> list[str]:
    """``args`` with ``...`` replaced by the required options they leave out.

    An options file (``NAME:@FILE``) that is not in the checkout is the reader's: ``NAME`` alone is checked.
    """
    args = [re.sub(r"^([^:=\s]+):@(.+)$", lambda m: m.group(0) if shell.path(m.group(2)).is_file() else m.group(1), arg)
            for arg in args]
    if PLACEHOLDER not in args:
        return args
    args = [arg for arg in args if arg != PLACEHOLDER]
    given = {arg.split("=", 1)[0].replace("-", "_").lstrip("_") for arg in args if arg.startswith("--")}
    for option, value in REQUIRED.get(args[0] if args else "", {}).items():
        if option.lstrip("-") not in given:
            args += [option, value]
    return args


def check_hermes_batch(args: list[str], shell: Shell) -> Optional[str]:
    args = _complete(args, shell)
    # --tasks is read when the command starts (it writes the suite's rows): from the checkout, as pasted there
    args = [str(shell.path(arg)) if i and args[i - 1] in ("--tasks",) else arg for i, arg in enumerate(args)]
    try:
        ctx = _parse(cli, "hermes-batch", args)
        dataset = ctx.params.get("dataset_file")
        if dataset is not None and str(dataset) != REQUIRED["run"]["--dataset_file"] and not shell.path(str(dataset)).is_file():
            return (f"reads the dataset {dataset}, which is no file of the checkout nor one an earlier command made; "
                    "use examples/prompts.jsonl, or make the file first")
        if ctx.command.name == "run":
            return check_run(ctx)
        if ctx.command.name == "new-plugin":
            return make_plugin(ctx, shell)
        registry = plugins.get_plugin_manager().registry()
        if ctx.params.get("format_"):
            selection.plugin(registry, "writers", ctx.params["format_"], "--format")
        if ctx.params.get("filter_"):
            selection.filters(registry, tuple(ctx.params["filter_"]), whole_run=True)
        if ctx.params.get("split"):
            parse_splits(ctx.params["split"])
    except click.exceptions.Exit:
        return None
    except click.ClickException as exc:
        return exc.format_message()
    except HermesBatchError as exc:
        return str(exc)
    return None


def check_run(ctx: click.Context) -> Optional[str]:
    """Build the run's configuration with the real command, then select what it names, as the run would."""
    seen = []
    keys = {"OPENROUTER_API_KEY": "example", "OPENAI_API_KEY": "example", "ANTHROPIC_API_KEY": "example"}
    if ctx.params.get("resume"):  # the example continues a run an earlier command made (in the scratch folder)
        folder = Path(ctx.params["output_dir"]) / ctx.params["run_name"]
        if not folder.exists():
            folder.mkdir(parents=True)
            config = {"dataset_file": REQUIRED["run"]["--dataset_file"], "batch_size": 10}
            (folder / "run.json").write_text(json.dumps({"config": config}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_cli, "execute", lambda config: seen.append(config) or 0)
        for name, value in keys.items():
            patch.setenv(name, value)
        try:
            with ctx:
                ctx.command.invoke(ctx)
        except SystemExit:
            pass
    if not seen:
        return "stopped before its run would start (see above)"
    config = seen.pop()
    registry = plugins.get_plugin_manager().registry()
    if config.distribution_file is None:  # else the distribution is in the user's file
        selection.distribution(registry, config.distribution)
    selection.sandbox_backend(registry, config.sandbox, config.sandbox_options)
    selection.executor(registry, config.executor, config.executor_options)
    selection.filters(registry, config.filters)
    selection.writers(registry, config.writers)
    selection.verifiers(registry, config.verifiers)
    build_runtimes(registry, (), config.tool_options, model_settings(config, 1))
    return None


def make_plugin(ctx: click.Context, shell: Shell) -> Optional[str]:
    """Run ``new-plugin`` for real, in the scratch folder; the folder it makes is where a later ``cd`` goes."""
    before = set(shell.scratch.iterdir())
    result = CliRunner().invoke(cli, ["new-plugin", ctx.params["name"], "--directory", str(shell.scratch)])
    if result.exit_code != 0:
        return result.output.strip()
    for made in set(shell.scratch.iterdir()) - before:
        shell.made[made.name] = made
    return None


def check_pip(args: list[str], shell: Shell) -> Optional[str]:
    if not args or args[0] != "install":
        return f"runs pip {args[0] if args else ''}; only `pip install` is checked"
    targets = [arg for arg in args[1:] if not arg.startswith("-")]
    core = False
    for target in targets:
        path_text, _, extras = target.partition("[")
        extras = extras.rstrip("]")
        if not (path_text.startswith((".", "/")) or "/" in path_text or shell.path(path_text).is_dir()):
            dist = next((d for d in plugins.FIRST_PARTY if d.distribution == path_text.lower()), None)
            fix = f"; install it from this checkout: {dist.install}" if dist else (
                "; install it from this checkout: pip install ." if path_text.lower() == "hermes-batch" else "")
            return f"installs {target!r} from a package index, where no hermes-batch distribution is yet{fix}"
        path = shell.path(path_text)
        pyproject = path / "pyproject.toml"
        if not pyproject.is_file():
            return f"installs {path_text!r}, which is no folder with a pyproject.toml here"
        project = tomllib.loads(pyproject.read_text())["project"]
        missing = [e.strip() for e in extras.split(",") if e.strip() and e.strip() not in project.get("optional-dependencies", {})]
        if missing:
            return f"asks for the extras {', '.join(missing)} of {path_text!r}, which it does not define"
        core = core or path == REPO
        inside = REPO in path.parents
        depends = any(re.match(r"hermes-batch\b(?!-)", dep) for dep in project.get("dependencies", []))
        if inside and depends and not any(shell.path(t.partition("[")[0]) == REPO for t in targets):
            return (f"installs the plugin {path_text!r} without the core: pip looks for hermes-batch on a package index "
                    f"and fails; install both in one command: pip install . {path_text}")
    return None if targets else "installs nothing"


def check_script(program: str, args: list[str], shell: Shell) -> Optional[str]:
    path = shell.path(program)
    if not path.is_file():
        return f"runs {program}, which does not exist"
    if not os.access(path, os.X_OK):
        return f"runs {program}, which is not executable"
    usage = re.search(r'case "\$\{1:-\w*\}" in\n(.*?)\n\s*esac', path.read_text(), re.S)
    if usage and args:
        accepted = {word for arm in re.findall(r"^\s*([\w|-]+)\)", usage.group(1), re.M) for word in arm.split("|")}
        if args[0] not in accepted:
            return f"passes {args[0]!r} to {program}, which takes {', '.join(sorted(accepted))}"
    return None


def check_python(args: list[str], shell: Shell) -> Optional[str]:
    if args[:2] == ["-m", "venv"]:
        return None
    if args[:2] == ["-m", "pytest"]:
        for arg in args[2:]:
            if not arg.startswith("-") and not shell.path(arg.split("::")[0]).exists():
                return f"runs the tests of {arg}, which does not exist"
        return None
    if not args or args[0].startswith("-"):
        return f"runs python {' '.join(args)}; only a script or -m pytest/venv is checked"
    script = shell.path(args[0])
    if not script.is_file():
        return f"runs {args[0]}, which does not exist"
    options = [arg.split("=", 1)[0] for arg in args[1:] if arg.startswith("--")]
    if options:
        shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        unknown = [option for option in options if not re.search(rf"{re.escape(option)}\b", shown.stdout)]
        if shown.returncode != 0 or unknown:
            return f"passes {', '.join(unknown) or ' '.join(options)} to {args[0]}, whose --help does not list it"
    return None


def check_cd(args: list[str], shell: Shell) -> Optional[str]:
    target = shell.path(args[0]) if args else Path.home()
    if not target.is_dir():
        return f"goes to {args[0]!r}, which is neither a folder of the checkout nor one an earlier command made"
    shell.cwd = target
    return None


def check_activate(args: list[str], shell: Shell) -> Optional[str]:
    """``. .venv/bin/activate``: the virtual environment the README's set-up makes (it need not exist yet)."""
    if args == [".venv/bin/activate"] or (args and shell.path(args[0]).is_file()):
        return None
    return f"sources {' '.join(args) or 'nothing'}, which is neither .venv/bin/activate nor a file of the checkout"


def check_click_program(name: str, args: list[str]) -> Optional[str]:
    module, _, attr = CLICK_PROGRAMS[name].partition(":")
    try:
        command = getattr(importlib.import_module(module), attr)
    except ImportError:  # ray: only scripts/test.sh --all installs it
        pytest.skip(f"{name} is not installed here to check its command line (scripts/test.sh --all installs it)")
    try:
        _parse(command, name, args)
    except click.exceptions.Exit:
        return None
    except click.ClickException as exc:
        return exc.format_message()
    return None


def problems_of(block: Block, scratch: Path) -> list[str]:
    shell = Shell(scratch)
    found = list(block.problems)
    for command in block.commands:
        with contextlib.redirect_stdout(sys.stderr):  # a command's own output is not the test's
            problem = check(command, shell)
        if problem:
            found.append(f"{command.where()}: {problem}")
    return found


BLOCKS = [block for document in DOCUMENTS for block in read_blocks(document)]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.id)
def test_the_shell_example_works_when_pasted(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a check does lands in the checkout
    problems = problems_of(block, tmp_path)
    assert not problems, "\n".join(problems)


def test_the_readme_says_once_how_to_paste_the_documents_bare_commands():
    """The documents write `hermes-batch` and `pip` bare, where the README installs into .venv/bin/: it says to
    activate the virtual environment, in an example of its own, before its first bare command."""
    readme = REPO / "README.md"
    commands = [command for block in read_blocks(readme) for command in block.commands]
    activate = next(i for i, command in enumerate(commands) if command.words[:2] in ((".", ".venv/bin/activate"),
                                                                                   ("source", ".venv/bin/activate")))
    bare = [i for i, command in enumerate(commands) if command.words and command.words[0] in ("hermes-batch", "pip")]
    assert not bare or activate < bare[0], commands[bare[0]].where()
    documents = [document for document in DOCUMENTS if document != readme]
    assert any(c.words[:1] == ("hermes-batch",) for d in documents for b in read_blocks(d) for c in b.commands)


def test_the_examples_were_found():
    found = {block.document.relative_to(REPO).as_posix() for block in BLOCKS}
    assert {"README.md", "docs/executors.md", "docs/sandboxes.md", "hermes_batch_docker/README.md",
            "plugins/hermes_batch_ray/README.md"} <= found
    assert sum(len(block.commands) for block in BLOCKS) > 60


BROKEN = """\
# A document someone just wrote

```bash
hermes-batch run --dataset_file prompts.jsonl --run_name big \\
    --num_workers 512 --executor processes -E workers=4
pip install hermes-batch-ray      # on every node
.venv/bin/pip install ./plugins/hermes_batch_ray
hermes-batch run ... --sandbox docker -S memroy=2g
hermes-batch export data/run --format parquet:compresion=zstd
scripts/apptainer.sh restart
nosuchtool --flag
```

Or install it with `pip install ./plugins/hermes_batch_nothere`.

    hermes-batch run --dataset_file d.jsonl --batch_size 1 --run_name r

```
hermes-batch stats data/run
```
"""


def test_a_broken_example_fails_naming_its_file_line_and_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    document = REPO / "docs" / "new.md"
    problems = [p for block in read_blocks(document, BROKEN) for p in problems_of(block, tmp_path)]
    assert problems[0] == (
        "docs/new.md:4: `hermes-batch run --dataset_file prompts.jsonl --run_name big --num_workers 512 --executor "
        "processes -E workers=4`: Missing option '--batch_size' / '--batch-size'."
    )
    assert problems[1] == (
        "docs/new.md:6: `pip install hermes-batch-ray`: installs 'hermes-batch-ray' from a package index, where no "
        "hermes-batch distribution is yet; install it from this checkout: pip install . ./plugins/hermes_batch_ray"
    )
    assert problems[2].startswith("docs/new.md:7: `.venv/bin/pip install ./plugins/hermes_batch_ray`: installs the "
                                  "plugin './plugins/hermes_batch_ray' without the core")
    assert problems[3].startswith("docs/new.md:8: `hermes-batch run ... --sandbox docker -S memroy=2g`: The docker "
                                  "sandbox (-S) has no option 'memroy'")
    assert problems[4].startswith("docs/new.md:9: `hermes-batch export data/run --format parquet:compresion=zstd`: "
                                  "The writer parquet has no option 'compresion'")
    assert problems[5] == ("docs/new.md:10: `scripts/apptainer.sh restart`: passes 'restart' to scripts/apptainer.sh, "
                           "which takes all, stop")
    assert problems[6].startswith("docs/new.md:11: `nosuchtool --flag`: runs 'nosuchtool', which this test does not know")
    assert problems[7].startswith("docs/new.md:14: `pip install ./plugins/hermes_batch_nothere`: installs "
                                  "'./plugins/hermes_batch_nothere', which is no folder")
    assert problems[8] == "docs/new.md:16: an indented code block is not checked; fence it with ```bash"
    assert problems[9] == ("docs/new.md:18: a block of shell commands without a language is not checked; "
                           "open it with ```bash")
    assert len(problems) == 10
