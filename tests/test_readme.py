"""Every example in README.md runs as shown, each block against a fresh daemon.

How README.md writes an example so that this runs it (a reader still reads a
terminal session):

- A ```console block is a shell session: a line `$ COMMAND` is run, with the
  lines right under it that start `> ` as its continuation (a here-document, a
  long line, as a terminal shows them); the lines under those, up to the next
  `$ `, are what it prints, stdout and stderr together. The commands of a block
  run one after another in one bash, so `cd`, variables and `$?` carry on.
- What differs from run to run is written as a reader would see it, and matched
  loosely: ids (`w-` or `r-` and ten hex digits) and numbers of five digits or
  more (pids, times) stand for whatever the daemon printed in their place the
  first time they are shown, and for that same value wherever they come again
  in the block, commands included (`subagentctl stop w-2f293a3f0d` stops the
  worker the earlier `spawn` printed). `...` in a line matches any text on that
  line; a line that is only `...` matches any number of lines, none included.
  Runs of spaces match runs of spaces (a table's columns widen with its values),
  and trailing spaces are ignored.
- ```console noexec marks a block that cannot run here (it installs, or talks
  to a systemd manager), visibly, in the fence; keep those few.
- A ```python block is run as a script (the venv's python), and must exit 0.
  A ```toml block is an agents.toml: `subagentd --check` must take it. Either
  skips with `noexec` too. A ```json block must parse; other blocks are text.

Each block runs in a fresh temporary directory (also its TMPDIR), with HOME a
fresh directory in it, the venv's bin first on PATH, no XDG_* variables, and
SUBAGENTD_SOCKET the socket of a daemon of its own (tests/conftest.py), started
with that HOME's `~/.config/subagentd/agents.toml` as its config (and that PATH,
so its workers find subagentctl too): a block may write one and reload. Output
is read from a pipe, as `| cat` would (Python unbuffered, so stdout and stderr
interleave as on a terminal). A failing block prints the command, then a diff
of what the README shows against what ran, so a block is fixed from the
message alone.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from .conftest import BIN, DaemonProcess

README = Path(__file__).parent.parent / "README.md"
#: The whole of one block; a command that hangs shows as the one without its output.
BLOCK_TIMEOUT = 120.0
#: Printed by the shell after each command's output, so the outputs can be told apart.
MARK = "\x1ereadme-step\x1e"

_FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")
#: What varies from run to run: worker and run ids, and numbers of five digits or more.
_VARYING = re.compile(r"\b(?P<id>[wr]-[0-9a-f]{10})\b|(?<![\w.-])(?P<number>\d{5,})(?!\w)")
_ELLIPSIS = "..."


@dataclass(frozen=True)
class Block:
    """One fenced block of the README: its language, its flags and its text."""

    line: int  # of the opening fence, 1-based
    lang: str
    flags: frozenset[str]
    text: str

    @property
    def runs(self) -> bool:
        return self.lang in {"console", "python", "toml"} and "noexec" not in self.flags


@dataclass(frozen=True)
class Step:
    """A command of a console block and what the README shows it print."""

    line: int
    command: str
    expected: list[str]


def fenced_blocks(markdown: str) -> list[Block]:
    """The blocks fenced by ``` at the start of a line, in order."""
    found: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"README.md:{start + 1}: a ``` block that never closes")
        lang, flags = opening.group(1), frozenset(opening.group(2).split())
        found.append(Block(start + 1, lang, flags, "\n".join(body) + "\n"))
        i += 1
    return found


def session_steps(block: Block) -> list[Step]:
    """A console block's commands, each with the lines shown under it."""
    steps: list[Step] = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        number = block.line + 1 + i
        text = lines[i]
        if not text.startswith("$ "):
            raise AssertionError(
                f"README.md:{number}: output before any `$ ` command in a console block: {text!r}"
            )
        command = text[2:]
        i += 1
        while i < len(lines) and (lines[i] == ">" or lines[i].startswith("> ")):
            command += "\n" + lines[i][2:]
            i += 1
        expected: list[str] = []
        while i < len(lines) and not lines[i].startswith("$ "):
            expected.append(lines[i])
            i += 1
        steps.append(Step(number, command, expected))
    return steps


@dataclass
class Bindings:
    """What each varying value the README shows stood for in this run."""

    values: dict[str, str] = field(default_factory=dict)

    def apply(self, text: str) -> str:
        """`text` with every bound value replaced by what it stood for."""
        return _VARYING.sub(lambda m: self.values.get(m.group(0), m.group(0)), text)

    def copy(self) -> Bindings:
        return Bindings(dict(self.values))


def _line_pattern(expected: str, bindings: Bindings) -> tuple[re.Pattern[str], list[str]]:
    """A regular expression for one expected line, and the unbound values its groups bind."""
    parts: list[str] = []
    groups: list[str] = []
    pos = 0
    tokens = re.compile(re.escape(_ELLIPSIS) + "|" + _VARYING.pattern)
    for match in tokens.finditer(expected):
        parts.append(_literal(expected[pos : match.start()]))
        token = match.group(0)
        if token == _ELLIPSIS:
            parts.append(".*?")
        elif token in bindings.values:
            parts.append(re.escape(bindings.values[token]))
        elif token in groups:
            parts.append(f"(?P=v{groups.index(token)})")
        else:
            shape = rf"{token[:2]}[0-9a-f]{{10}}" if match.group("id") else r"\d+"
            parts.append(f"(?P<v{len(groups)}>{shape})")
            groups.append(token)
        pos = match.end()
    parts.append(_literal(expected[pos:]))
    return re.compile("".join(parts)), groups


def _literal(text: str) -> str:
    return " +".join(re.escape(piece) for piece in re.split(r" {1,}", text))


def match_output(expected: list[str], actual: list[str], bindings: Bindings) -> Bindings | None:
    """The bindings under which `actual` is what `expected` shows; None if it is not."""
    expected = [line.rstrip() for line in expected]
    actual = [line.rstrip() for line in actual]

    def at(e: int, a: int, bound: Bindings) -> Bindings | None:
        if e == len(expected):
            return bound if a == len(actual) else None
        if expected[e] == _ELLIPSIS:
            for skip in range(a, len(actual) + 1):
                if (found := at(e + 1, skip, bound)) is not None:
                    return found
            return None
        if a == len(actual):
            return None
        pattern, groups = _line_pattern(expected[e], bound)
        line = pattern.fullmatch(actual[a])
        if line is None:
            return None
        more = bound.copy()
        for i, token in enumerate(groups):
            value = line.group(f"v{i}")
            if _VARYING.fullmatch(token).group("id") and value in more.values.values():  # type: ignore[union-attr]
                return None  # two ids the README tells apart are one here
            more.values[token] = value
        return at(e + 1, a + 1, more)

    return at(0, 0, bindings)


def _failure(block: Block, step: Step, actual: list[str], bindings: Bindings) -> str:
    # A line that matches on its own is shown as it ran, so that the diff holds only the
    # lines that differ, not every pid and time.
    shown = [
        actual[i]
        if i < len(actual) and match_output([line], [actual[i]], bindings) is not None
        else bindings.apply(line)
        for i, line in enumerate(step.expected)
    ]
    diff = difflib.unified_diff(shown, actual, "README.md", "ran", lineterm="", n=20)
    return (
        f"README.md:{step.line}: the block of line {block.line} printed other than it shows\n"
        f"$ {bindings.apply(step.command)}\n" + "\n".join(diff)
    )


def _environment(daemon: DaemonProcess, home: Path) -> dict[str, str]:
    """What a block runs with: a reader's shell, with nothing of this machine's own."""
    env = {
        k: v
        for k, v in daemon.env.items()
        if not k.startswith("XDG_") and k not in {"PYTHONPATH", "COLUMNS", "LINES"}
    }
    return env | {
        "HOME": str(home),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "SUBAGENTD_SOCKET": str(daemon.socket),
        "TMPDIR": str(home.parent),
        # Lines in the order a terminal shows them: Python writes a pipe in blocks else.
        "PYTHONUNBUFFERED": "1",
    }


async def _run_console(
    block: Block, daemon: DaemonProcess, where: Path, home: Path, within: float = BLOCK_TIMEOUT
) -> None:
    steps = session_steps(block)
    bindings = Bindings()
    # One shell for the block, so variables, `cd` and `$?` carry from one command to the
    # next; each command is written to it once the one before has printed, since it may
    # name an id that one printed. The shell reads its stdin a byte at a time (a pipe), and
    # each command's own stdin is /dev/null, so no command reads the next.
    shell = await trio.lowlevel.open_process(
        ["bash", "--noprofile", "--norc"],
        cwd=where,
        env=_environment(daemon, home),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert shell.stdin is not None
    assert shell.stdout is not None
    end = f"\n{MARK}\n".encode()
    buffer = b""
    command = ""
    try:
        with trio.fail_after(within):
            for step in steps:
                command = bindings.apply(step.command)
                await shell.stdin.send_all(
                    f"{{ {command}\n}} </dev/null 2>&1\n"
                    f"__readme_status=$?; printf '\\n{MARK}\\n'; (exit $__readme_status)\n".encode()
                )
                while end not in buffer:
                    more = await shell.stdout.receive_some()
                    if not more:
                        raise AssertionError(
                            f"README.md:{step.line}: the shell exited at `{command}`:\n"
                            + buffer.decode("utf-8", errors="replace")
                        )
                    buffer += more
                printed, _, buffer = buffer.partition(end)
                # The mark begins with a newline, for output that ends without one.
                text = printed.decode("utf-8", errors="replace").removesuffix("\n")
                actual = text.split("\n") if text else []
                matched = match_output(step.expected, actual, bindings)
                if matched is None:
                    raise AssertionError(_failure(block, step, actual, bindings))
                bindings = matched
    except trio.TooSlowError:
        raise AssertionError(
            f"README.md:{step.line}: `{command}` did not end within the block's "
            f"{within:g} s; it printed:\n" + buffer.decode("utf-8", errors="replace")
        ) from None
    finally:
        with trio.CancelScope(shield=True):
            await shell.stdin.aclose()
            with trio.move_on_after(10):
                await shell.wait()
            if shell.returncode is None:
                shell.kill()
                await shell.wait()
            await shell.stdout.aclose()


async def _run_python(block: Block, daemon: DaemonProcess, where: Path, home: Path) -> None:
    script = where / f"readme_{block.line}.py"
    script.write_text(block.text)
    with trio.move_on_after(BLOCK_TIMEOUT) as scope:
        done = await trio.run_process(
            [str(BIN / "python"), str(script)],
            cwd=where,
            env=_environment(daemon, home),
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if scope.cancelled_caught:
        raise AssertionError(
            f"README.md:{block.line}: the python example did not end within {BLOCK_TIMEOUT:.0f} s"
        )
    if done.returncode != 0:
        raise AssertionError(
            f"README.md:{block.line}: the python example exited {done.returncode}:\n"
            + done.stdout.decode("utf-8", errors="replace")
        )


async def _check_agents_toml(block: Block, daemon: DaemonProcess, where: Path, home: Path) -> None:
    config = where / "agents.toml"
    config.write_text(block.text)
    with trio.fail_after(BLOCK_TIMEOUT):
        done = await trio.run_process(
            [str(BIN / "subagentd"), "--check", "--config", str(config)],
            cwd=where,
            env=_environment(daemon, home),
            capture_stdout=True,
            stderr=subprocess.STDOUT,
            check=False,
        )
    said = done.stdout.decode("utf-8", errors="replace")
    if done.returncode != 0 or "(0 agents)" in said or "(unusable)" in said:
        raise AssertionError(f"README.md:{block.line}: subagentd --check refuses it:\n{said}")


_BLOCKS = fenced_blocks(README.read_text())


@pytest.mark.parametrize(
    "block",
    [b for b in _BLOCKS if b.runs],
    ids=[f"README.md:{b.line}-{b.lang}" for b in _BLOCKS if b.runs],
)
def test_readme_example_runs_as_shown(
    block: Block, daemon_dirs: DaemonProcess, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    daemon_dirs.config = home / ".config" / "subagentd" / "agents.toml"
    # The daemon as `make run` starts it: its venv's bin not on its PATH (the blocks'
    # workers that run `subagentctl` find it because the daemon puts its own bin there).
    path = os.environ.get("PATH", os.defpath).split(os.pathsep)
    daemon_dirs.start(env={"PATH": os.pathsep.join(d for d in path if Path(d) != BIN)})
    where = tmp_path / "work"
    where.mkdir()
    run = {"console": _run_console, "python": _run_python, "toml": _check_agents_toml}
    # On a loop of its own, not pytest-trio's, and without the traceback: a failure reads
    # as the command and the diff alone, not wrapped in the test nursery's exception group.
    try:
        trio.run(run[block.lang], block, daemon_dirs, where, home)
    except AssertionError as failed:
        failure = str(failed)
    else:
        return
    pytest.fail(failure, pytrace=False)


# The runner itself: each rule of the format above, and that a difference fails.

#: What a ```console noexec block may run: installs and a systemd user manager's commands.
CANNOT_RUN_HERE = ("make ", "pip ", "systemctl --user ")


def _match(expected: str, actual: str) -> Bindings | None:
    return match_output(expected.splitlines(), actual.splitlines(), Bindings())


def test_a_line_that_differs_fails_the_match() -> None:
    assert _match("w-91ae740dbe stopped", "w-0123456789 stopped") is not None
    assert _match("w-91ae740dbe stopped", "w-0123456789 finished") is None
    assert _match("one\ntwo", "one") is None
    assert _match("one", "one\ntwo") is None


def test_an_id_stands_for_the_same_value_wherever_it_comes_again() -> None:
    bound = _match("w-91ae740dbe (run r-c984d0b756)", "w-0123456789 (run r-aaaaaaaaaa)")
    assert bound is not None
    assert bound.apply("subagentctl stop w-91ae740dbe --run r-c984d0b756") == (
        "subagentctl stop w-0123456789 --run r-aaaaaaaaaa"
    )
    assert match_output(["w-91ae740dbe"], ["w-0123456789"], bound) is not None
    assert match_output(["w-91ae740dbe"], ["w-9999999999"], bound) is None
    assert _match("w-91ae740dbe w-91ae740dbe", "w-0123456789 w-9999999999") is None


def test_two_ids_the_readme_tells_apart_are_two_ids() -> None:
    assert _match("w-91ae740dbe\nw-2f293a3f0d", "w-0123456789\nw-0123456789") is None
    assert _match("w-91ae740dbe\nw-2f293a3f0d", "w-0123456789\nw-9876543210") is not None
    assert _match("w-91ae740dbe", "r-0123456789") is None  # a run's id is not a worker's


def test_a_pid_matches_any_number_but_a_short_number_only_itself() -> None:
    assert _match("pid=18649 wrote 13 bytes", "pid=702 wrote 13 bytes") is not None
    assert _match("pid=18649 wrote 13 bytes", "pid=702 wrote 14 bytes") is None
    assert _match("pid=18649", "pid=x") is None


def test_an_ellipsis_line_matches_any_lines_or_none() -> None:
    assert _match("a\n...\nz", "a\nz") is not None
    assert _match("a\n...\nz", "a\nb\nc\nz") is not None
    assert _match("a\n...\nz", "a\nb\nc") is None
    assert _match("...", "") is not None


def test_an_ellipsis_in_a_line_matches_within_that_line_only() -> None:
    assert _match("exit=0 tick 1...tick 3", r"exit=0 tick 1\ntick 2\ntick 3") is not None
    assert _match("a...z", "a\nz") is None
    assert _match('{"id":"w-91ae740dbe",...}', '{"id":"w-0123456789","pid":7}') is not None


def test_runs_of_spaces_match_runs_of_spaces_and_trailing_ones_are_ignored() -> None:
    assert _match("ID    PID  NAME", "ID  PID      NAME   ") is not None
    assert _match("ID PID", "IDPID") is None


def test_a_session_reads_as_commands_with_their_output() -> None:
    block = Block(10, "console", frozenset(), "$ cat <<'EOF'\n> a\n>\n> EOF\na\n\n$ true\n")
    steps = session_steps(block)
    assert [(s.line, s.command, s.expected) for s in steps] == [
        (11, "cat <<'EOF'\na\n\nEOF", ["a", ""]),
        (17, "true", []),
    ]
    with pytest.raises(AssertionError, match=r"README.md:11: output before any"):
        session_steps(Block(10, "console", frozenset(), "hello\n$ true\n"))


def test_fences_are_found_with_their_flags_and_an_open_one_is_an_error() -> None:
    found = fenced_blocks("text\n```console noexec\n$ make run\n```\n```python\nx = 1\n```\n")
    assert [(b.line, b.lang, b.runs) for b in found] == [(2, "console", False), (5, "python", True)]
    with pytest.raises(AssertionError, match="never closes"):
        fenced_blocks("```console\n$ true\n")


def test_the_blocks_that_do_not_run_are_the_few_that_cannot_here() -> None:
    for block in _BLOCKS:
        if block.lang == "console" and not block.runs:
            for step in session_steps(block):
                assert step.command.startswith(CANNOT_RUN_HERE), (
                    f"README.md:{step.line}: `{step.command}` is in a noexec block but could "
                    "run here: move it to a block that runs"
                )
    assert sum(b.runs for b in _BLOCKS) >= 10


def test_every_json_example_parses() -> None:
    shown = [b for b in _BLOCKS if b.lang == "json"]
    assert shown, "the MCP host configuration is a json block"
    for block in shown:
        try:
            json.loads(block.text)
        except json.JSONDecodeError as exc:
            raise AssertionError(f"README.md:{block.line}: not JSON: {exc}") from None


def test_no_example_hides_from_the_runner_in_an_indented_block() -> None:
    fenced = False
    for number, line in enumerate(README.read_text().splitlines(), start=1):
        fenced ^= line.startswith("```")
        assert fenced or not line.startswith("    $ "), (
            f"README.md:{number}: a shell example indented, which nothing runs: "
            "write it as a ```console block"
        )


async def test_a_block_that_prints_otherwise_fails_with_the_diff(
    daemon_dirs: DaemonProcess, tmp_path: Path
) -> None:
    block = Block(
        1,
        "console",
        frozenset(),
        "$ subagentctl spawn -- sleep 60\nw-91ae740dbe (run r-c984d0b756)\n"
        "$ subagentctl stop w-91ae740dbe\nw-91ae740dbe\n"
        "$ subagentctl status w-nope\nsubagentctl: not_found: no such worker\n",
    )
    daemon_dirs.start()
    (tmp_path / "home").mkdir()
    with pytest.raises(AssertionError) as failed:
        await _run_console(block, daemon_dirs, tmp_path, tmp_path / "home")
    message = str(failed.value)
    assert message.startswith("README.md:6: the block of line 1 printed other than it shows\n")
    assert "$ subagentctl status w-nope\n" in message
    assert "-subagentctl: not_found: no such worker\n" in message
    assert "+subagentctl: not_found: no worker 'w-nope'" in message


async def test_a_command_that_hangs_fails_naming_it(
    daemon_dirs: DaemonProcess, tmp_path: Path
) -> None:
    block = Block(1, "console", frozenset(), "$ echo before\nbefore\n$ echo half; sleep 600\n")
    daemon_dirs.start()
    (tmp_path / "home").mkdir()
    with trio.fail_after(30), pytest.raises(AssertionError) as failed:
        await _run_console(block, daemon_dirs, tmp_path, tmp_path / "home", within=2)
    assert str(failed.value) == (
        "README.md:4: `echo half; sleep 600` did not end within the block's 2 s; "
        "it printed:\nhalf\n"
    )
