"""A conservative reading of a shell command line: the simple commands it runs, their words and redirections.

For the shortcut audit (audit.py), which must see what a model's terminal command names without running it.
It knows quotes, escapes, comments, ``;``, ``&&``, ``||``, pipes, ``&``, subshells, ``$(...)`` and backticks,
here-documents, redirections, ``cd``, variables assigned earlier in the same command, and the commands that
run other commands (``sh -c``, ``bash -lc``, ``eval``, ``env``, ``sudo``, ``timeout``, ``nohup``, ``xargs``,
``find -exec``).  What it cannot know (a path built at run time, code handed to an interpreter, a script the
command sources) it leaves out: it never guesses, so a word it cannot read is not a finding.
"""

from __future__ import annotations

import posixpath
import re
from typing import Optional

import attrs

MAX_CHARS = 65536  # of one command read word by word, here-documents left out (the audit searches all as text)
MAX_DEPTH = 4  # commands inside commands: sh -c "eval '...'", xargs find -exec ...
MAX_COMMANDS = 2000  # simple commands read from one command line

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash", "mksh", "busybox"})
_KEYWORDS = frozenset({"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}", "case",
                       "esac", "time", "coproc"})
_REDIRECTS = frozenset({">", ">>", ">|", "&>", "&>>", ">&", "<", "<&", "<>", "<<", "<<-", "<<<"})
_WRITES = frozenset({">", ">>", ">|", "&>", "&>>", ">&", "<>"})
# longest first, so that ">>" is not read as two ">"
_OPS = ("&>>", "<<<", "<<-", "&&", "||", ";;", "|&", ">>", ">|", "&>", ">&", "<<", "<&", "<>",
        ";", "&", "|", "(", ")", "<", ">", "\n")
_OP = re.compile("|".join(re.escape(op) for op in _OPS))
_PLAIN = re.compile(r"[^\s'\"\\$`;&|()<>#]+")
_IN_DOUBLE = re.compile(r'[^"\\$`]+')
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


@attrs.frozen
class Command:
    """One simple command: its program and arguments, where it runs, and the files its redirections name."""

    words: tuple[str, ...]  # quotes removed; assignments and wrappers (sudo, env, timeout ...) left out
    cwd: Optional[str]  # the folder it runs in as far as cd tells (absolute); None when unknown
    writes: tuple[str, ...] = ()  # files its redirections write (>, >>, &>)
    reads: tuple[str, ...] = ()  # files its redirections read (<)

    @property
    def program(self) -> str:
        return posixpath.basename(self.words[0]) if self.words else ""


@attrs.frozen
class _Word:
    text: str
    inner: tuple[str, ...] = ()  # the commands of its $(...) and backticks


def resolve(word: str, cwd: Optional[str]) -> Optional[str]:
    """The absolute path ``word`` names from ``cwd``, or None when it cannot be known (a variable, ``~``)."""
    if not word or "$" in word or "`" in word or word.startswith("~"):
        return None
    if word.startswith("/"):
        return posixpath.normpath(word).replace("//", "/")
    if cwd is None:
        return None
    return posixpath.normpath(posixpath.join(cwd, word))


def read_commands(text: str, cwd: Optional[str], *, depth: int = 0, variables: Optional[dict] = None) -> list[Command]:
    """The simple commands of ``text`` in order, as run from ``cwd``; never raises on any text."""
    reader = _Reader(dict(variables or {}), depth)
    reader.run(text, cwd)
    return reader.out


class _Reader:
    def __init__(self, variables: dict, depth: int):
        self.variables = variables
        self.depth = depth
        self.out: list[Command] = []

    def run(self, text: str, cwd: Optional[str]) -> None:
        stack: list[Optional[str]] = []
        words: list[_Word] = []
        redirects: list[tuple[str, _Word]] = []
        pending: Optional[str] = None  # a redirection waiting for its word
        for token in _tokens(text):
            if len(self.out) >= MAX_COMMANDS:
                return
            if isinstance(token, _Word):
                if pending is not None:
                    redirects.append((pending, token))
                    pending = None
                else:
                    words.append(token)
                continue
            if token in _REDIRECTS:
                pending = token
                continue
            pending = None
            cwd = self._finish(words, redirects, cwd)
            words, redirects = [], []
            if token == "(":
                stack.append(cwd)
            elif token == ")" and stack:
                cwd = stack.pop()
        self._finish(words, redirects, cwd)

    def _finish(self, words: list, redirects: list, cwd: Optional[str]) -> Optional[str]:
        """Record one simple command; the folder the next one runs in (cd)."""
        if len(self.out) >= MAX_COMMANDS:
            return cwd
        for word in [*words, *(w for _op, w in redirects)]:
            for inner in word.inner:
                self.nested(inner, cwd)
        values = [self.expand(w.text, cwd) for w in words]
        while values and values[0] in _KEYWORDS:
            values.pop(0)
        if values and values[0] in ("for", "select", "function"):
            return cwd  # for NAME in WORDS: the words are a list, not paths of a command
        while values and _ASSIGNMENT.match(values[0]):
            name, _, value = values.pop(0).partition("=")
            self.variables[name] = value
        writes, reads = [], []
        for op, word in redirects:
            target = self.expand(word.text, cwd)
            if op in (">&", "<&") and (target.isdigit() or target == "-"):
                continue  # 2>&1: a file descriptor, not a file
            if op in ("<<", "<<-", "<<<"):
                continue  # a here-document's delimiter, a here-string's text
            (writes if op in _WRITES else reads).append(target)
        return self.emit(values, cwd, tuple(writes), tuple(reads))

    def expand(self, text: str, cwd: Optional[str]) -> str:
        if "$" not in text and "`" not in text:
            return text
        if cwd is not None:
            text = text.replace("$(pwd)", cwd).replace("`pwd`", cwd)

        def value(match: re.Match) -> str:
            name = match.group(1) or match.group(2)
            if name in self.variables:
                return self.variables[name]
            if name == "PWD" and cwd is not None:
                return cwd
            return match.group(0)

        return _VARIABLE.sub(value, text)

    def nested(self, text: str, cwd: Optional[str]) -> None:
        if self.depth < MAX_DEPTH and len(self.out) < MAX_COMMANDS:
            inner = _Reader(dict(self.variables), self.depth + 1)
            inner.run(text, cwd)
            self.out += inner.out[: MAX_COMMANDS - len(self.out)]

    def emit(self, values: list, cwd: Optional[str], writes: tuple, reads: tuple, hops: int = 0) -> Optional[str]:
        """Add the command ``values`` (after its wrappers), and the commands it runs; the folder after it."""
        values = _unwrap(values)
        if not values and not writes and not reads:
            return cwd
        program = posixpath.basename(values[0]) if values else ""
        while program == "xargs":  # xargs [options] COMMAND: the command, whatever the number of xargs
            self.out.append(Command(("xargs",), cwd, writes, reads))
            values, writes, reads = _unwrap(_xargs_command(values)), (), ()
            program = posixpath.basename(values[0]) if values else ""
        if hops >= MAX_DEPTH:  # find -exec find -exec ...: its words are read as they are
            program = ""
        if program in SHELLS and program != "busybox":
            script = _shell_script(values)
            if script is not None:
                self.out.append(Command(tuple(values[:1]), cwd, writes, reads))
                self.nested(script, cwd)
                return cwd
        if program == "eval":
            self.out.append(Command(("eval",), cwd, writes, reads))
            self.nested(" ".join(values[1:]), cwd)
            return cwd
        if program == "find":
            values, runs = _find_exec(values)
            self.out.append(Command(tuple(values), cwd, writes, reads))
            for run in runs:
                self.emit(run, cwd, (), (), hops + 1)
            return cwd
        self.out.append(Command(tuple(values), cwd, writes, reads))
        program = posixpath.basename(values[0]) if values else ""
        if program in ("cd", "pushd"):
            targets = [v for v in values[1:] if not v.startswith("-") or v == "-"]
            return resolve(targets[0], cwd) if targets and targets[0] != "-" else None
        if program == "popd":
            return None
        return cwd


def _unwrap(values: list) -> list:
    """The command a wrapper runs: ``sudo -u x env A=1 timeout 5 nice -n 3 CMD ...`` is CMD."""
    while values:
        program = posixpath.basename(values[0])
        if program in ("sudo", "doas"):
            values = _skip_options(values[1:], {"-u", "-g", "-C", "-D", "-h", "-p", "-U", "-r", "-t"})
        elif program == "env":
            rest = _skip_options(values[1:], {"-u", "-C", "--unset", "--chdir"})
            while rest and _ASSIGNMENT.match(rest[0]):
                rest = rest[1:]
            values = rest
        elif program in ("nohup", "exec", "builtin", "unbuffer", "stdbuf", "setsid", "chronic", "time"):
            values = _skip_options(values[1:], {"-a"})
        elif program == "nice" or program == "ionice":
            values = _skip_options(values[1:], {"-n", "-c", "-p"})
        elif program == "timeout":
            rest = _skip_options(values[1:], {"-s", "-k", "--signal", "--kill-after"})
            values = rest[1:]  # the duration
        elif program == "command":
            if len(values) > 1 and values[1] in ("-v", "-V"):
                return values  # a lookup, it runs nothing
            values = _skip_options(values[1:], set())
        elif program == "busybox" and len(values) > 1:
            values = values[1:]
        else:
            return values
    return values


def _skip_options(values: list, with_argument: set) -> list:
    i = 0
    while i < len(values) and values[i].startswith("-") and values[i] != "-":
        if values[i] == "--":
            return values[i + 1:]
        i += 2 if values[i] in with_argument else 1
    return values[i:]


def _shell_script(values: list) -> Optional[str]:
    """The script of ``sh -c SCRIPT`` (also -lc, -ec, -o pipefail -c ...), None for a shell given a file."""
    i, has_c = 1, False
    while i < len(values) and values[i][:1] in ("-", "+") and values[i] not in ("-", "--"):
        option = values[i]
        if option in ("-o", "+o", "-O", "+O"):
            i += 2
            continue
        if not option.startswith("--") and "c" in option[1:]:
            has_c = True
        i += 1
    return values[i] if has_c and i < len(values) else None


def _find_exec(values: list) -> tuple[list, list]:
    """find's own words, and the commands of its -exec, -execdir, -ok and -okdir."""
    own, runs, i = [], [], 0
    while i < len(values):
        if values[i] in ("-exec", "-execdir", "-ok", "-okdir"):
            run = []
            i += 1
            while i < len(values) and values[i] not in (";", "+"):
                run.append(values[i])
                i += 1
            runs.append(run)
        else:
            own.append(values[i])
        i += 1
    return own, runs


_XARGS_ARGUMENT = {"-n", "-I", "-i", "-L", "-P", "-d", "-s", "-E", "-e", "-a", "--max-args", "--replace",
                   "--max-lines", "--max-procs", "--delimiter", "--arg-file"}


def _xargs_command(values: list) -> list:
    rest = _skip_options(values[1:], _XARGS_ARGUMENT)
    return rest or ["echo"]


# -- tokens --------------------------------------------------------------------------------------


def _tokens(text: str):
    """Words (quotes removed) and operators of ``text``; here-document bodies are skipped, and what comes after
    the first MAX_CHARS characters of the rest."""
    i, n = 0, len(text)
    skipped = 0  # characters of here-documents
    parts: list[str] = []
    inner: list[str] = []
    in_word = quoted = False
    heredocs: list[tuple[str, bool]] = []  # (delimiter, strip tabs) of here-documents that start at the next line
    delimiter_of: Optional[str] = None  # "<<" or "<<-": the next word is a here-document's delimiter

    def word():
        nonlocal parts, inner, in_word, quoted, delimiter_of
        made = _Word("".join(parts), tuple(inner))
        if delimiter_of is not None:
            heredocs.append((made.text, delimiter_of == "<<-"))
            delimiter_of = None
        parts, inner, in_word, quoted = [], [], False, False
        return made

    while i < n and i - skipped < MAX_CHARS:
        plain = _PLAIN.match(text, i)
        if plain:
            parts.append(plain.group())
            in_word = True
            i = plain.end()
            continue
        c = text[i]
        if c in " \t\r\f\v":
            if in_word:
                yield word()
            i += 1
        elif c == "#":
            if in_word:
                parts.append(c)
                i += 1
            else:  # a comment, to the end of the line
                end = text.find("\n", i)
                i = n if end < 0 else end
        elif c == "\\":
            if i + 1 < n and text[i + 1] == "\n":
                i += 2  # a continued line
            else:
                parts.append(text[i + 1:i + 2])
                in_word = True
                i += 2
        elif c == "'":
            end = text.find("'", i + 1)
            end = n if end < 0 else end
            parts.append(text[i + 1:end])
            in_word = quoted = True
            i = end + 1
        elif c == '"':
            i = _double_quoted(text, i + 1, parts, inner)
            in_word = quoted = True
        elif c == "$" or c == "`":
            i = _substitution(text, i, parts, inner)
            in_word = True
        else:
            op = _OP.match(text, i).group()
            if op[0] in "<>" and in_word and not quoted and "".join(parts).isdigit():
                parts, inner, in_word = [], [], False  # 2>file: the number is a file descriptor
            elif in_word:
                yield word()
            i += len(op)
            if op in ("<<", "<<-"):
                delimiter_of = op
            if op == "\n" and heredocs:
                start, i = i, _skip_heredocs(text, i, heredocs)
                skipped += i - start
                heredocs = []
            yield op
    if in_word:
        yield word()


def _double_quoted(text: str, i: int, parts: list, inner: list) -> int:
    n = len(text)
    while i < n:
        plain = _IN_DOUBLE.match(text, i)
        if plain:
            parts.append(plain.group())
            i = plain.end()
            continue
        c = text[i]
        if c == '"':
            return i + 1
        if c == "\\":
            following = text[i + 1:i + 2]
            parts.append(following if following in ('"', "\\", "$", "`") else "\\" + following)
            i += 2
        else:
            i = _substitution(text, i, parts, inner)
    return n


def _substitution(text: str, i: int, parts: list, inner: list) -> int:
    """``$(...)``, ``$((...))``, ``${...}``, ``$NAME`` or a backtick command at ``i``, kept as typed; the commands
    of ``$(...)`` and backticks go to ``inner``."""
    if text[i] == "`":
        end = text.find("`", i + 1)
        end = len(text) if end < 0 else end
        inner.append(text[i + 1:end])
        parts.append(text[i:end + 1])
        return end + 1
    if text.startswith("$((", i):
        end = _closing(text, i + 1)
        parts.append(text[i:end])
        return end
    if text.startswith("$(", i):
        end = _closing(text, i + 1)
        inner.append(text[i + 2:end - 1])
        parts.append(text[i:end])
        return end
    if text.startswith("${", i):
        end = text.find("}", i)
        end = len(text) if end < 0 else end + 1
        parts.append(text[i:end])
        return end
    parts.append("$")
    return i + 1


def _closing(text: str, i: int) -> int:
    """The index after the parenthesis that closes the one at ``i`` (quotes inside skipped)."""
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        elif c in "'\"":
            end = text.find(c, i + 1)
            i = n if end < 0 else end
        elif c == "\\":
            i += 1
        i += 1
    return n


def _skip_heredocs(text: str, i: int, heredocs: list) -> int:
    """The index after the bodies of ``heredocs``, which start at ``i``."""
    n = len(text)
    for delimiter, strip_tabs in heredocs:
        end = re.compile(rf"^{chr(9) + '*' if strip_tabs else ''}{re.escape(delimiter)}$", re.MULTILINE).search(text, i)
        i = n if end is None else end.end() + 1
    return min(i, n)
