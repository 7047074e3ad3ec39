"""The package in layers, read from its own imports (issue 25, item 2): each part imports
only the parts below it, no two parts import each other, no files import each other in a
circle. This module is where the layers are named (docs/design.md says the same in words).

Every import is read with `ast`, none run: those under ``if TYPE_CHECKING:`` count (a
type is a dependency too), and so do those inside a function. One arrow is one import
of one module: ``from ..store._store import Change, Store`` is one arrow, ``from . import
a, b`` two. An import of a package's name (``subagentd.protocol``) is an arrow to its
``__init__.py``; the package ``__init__`` a submodule's import runs on the way is not one.

Run as ``python -m tests.test_layers`` it prints the graph: every arrow between two
parts, counted, then what each rule finds, arrow by arrow, for the refactor to follow.
"""

from __future__ import annotations

import ast
import collections
import sys
import tomllib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: A part is a folder (named with its trailing ``/``) or one file; a stack is its layers,
#: the lowest first, each a tuple of parts that may import one another one way (never
#: both), and every layer below. protocol/ is the floor of both stacks: the daemon and the
#: clients share only it (the socket between them), and neither imports the other.
DAEMON: tuple[tuple[str, ...], ...] = (
    # The wire: messages, framing, errors. No I/O, no trio.
    ("protocol/",),
    # The decisions: registry, wakes, authority, keys, a connection's session. Pure.
    ("daemon/core/",),
    # What every part below the top reports to or is told: the log, the problems `info`
    # shows, the settings a start was given, the garbage collector's pause, a test's faults.
    (
        "daemon/_logging.py",
        "daemon/_problems.py",
        "daemon/_settings.py",
        "daemon/_collector.py",
        "daemon/_faults.py",
    ),
    # What is kept on disk, and the OS side of a worker (the launcher port).
    ("daemon/store/", "daemon/processes/"),
    # The parts on trio, each owning its state: supervisor, reader, mailbox, endings...
    ("daemon/workers/",),
    # The composition root: the parts built and wired, and the verbs that span them.
    ("daemon/_daemon.py",),
    # The control socket: a connection's trio shell, dispatching to the daemon's verbs.
    ("daemon/serving/",),
    # The daemon's life across images: start, serve, reload, recover. It builds the
    # daemon and the server, so it stands above both.
    ("daemon/lifecycle/",),
    # The entry point: the command line, `python -m subagentd.daemon`.
    ("daemon/_main.py", "daemon/__main__.py", "daemon/__init__.py"),
)
CLIENT: tuple[tuple[str, ...], ...] = (
    ("protocol/",),
    # Leaves: the one sanitiser, units, times, task groups, the ack ledger.
    (
        "client/_text.py",
        "client/_figures.py",
        "client/_units.py",
        "client/_when.py",
        "client/_tasks.py",
        "client/_acks.py",
    ),
    # The sans-I/O core both clients share.
    ("client/_core.py",),
    # The stop switch: made of requests, on a protocol both clients satisfy.
    ("client/_switch.py",),
    # The two thin shells.
    ("client/_sync.py", "client/_async.py"),
    # What a person or a model runs: the CLI, top, subagentd-mcp and its rooms.
    ("client/_cli.py", "client/_top.py", "client/_mcp*.py"),
    # The re-exports: one import serves a caller.
    ("client/__init__.py",),
)
STACKS: Mapping[str, tuple[tuple[str, ...], ...]] = {"daemon": DAEMON, "client": CLIENT}

# -- reading the imports -----------------------------------------------------------------


@dataclass(frozen=True)
class Arrow:
    """One import of one module by another, where it is written."""

    file: str  # the importer, relative to the tree's root: daemon/store/_journal.py
    line: int
    target: str  # the imported module's file: daemon/lifecycle/_carried.py
    type_only: bool = False  # under `if TYPE_CHECKING:`
    in_function: bool = False  # inside a function: imported when it first runs

    def how(self, what: str) -> str:
        """`what`, and how it is imported where that is not plainly."""
        words = [what] + ["type-only"] * self.type_only + ["in a function"] * self.in_function
        return ", ".join(words)

    def where(self) -> str:
        return f"{self.file}:{self.line} -> {self.how(self.target)}"


def packages(root: Path) -> dict[str, str]:
    """Each package of the tree and its folder (relative to `root`), as pyproject says."""
    with (root / "pyproject.toml").open("rb") as f:
        config = tomllib.load(f)
    return dict(config["tool"]["setuptools"]["package-dir"])


def modules(root: Path, sources: Mapping[str, str]) -> dict[str, str]:
    """Every module under the packages: its dotted name -> its file, relative to `root`."""
    found: dict[str, str] = {}
    for package, folder in sources.items():
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root / folder).with_suffix("").parts
            if relative[-1] == "__init__":
                relative = relative[:-1]
            found[".".join((package, *relative))] = path.relative_to(root).as_posix()
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    nodes: Iterable[ast.AST], *, type_only: bool = False, in_function: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import under `nodes`, and whether it is type-only, inside a function."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, type_only, in_function
            continue
        if (by_name := _import_module(node)) is not None:
            yield by_name, type_only, in_function
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.body, type_only=True, in_function=in_function)
            yield from _imports(node.orelse, type_only=type_only, in_function=in_function)
        else:
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            yield from _imports(ast.iter_child_nodes(node), type_only=type_only, in_function=inner)


def _import_module(node: ast.AST) -> ast.Import | None:
    """``importlib.import_module("a.b")`` with a literal name, read as ``import a.b``."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    called = node.func
    name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", None)
    if name != "import_module" or not isinstance(node.args[0].value, str):
        return None
    return ast.Import(names=[ast.alias(node.args[0].value)], lineno=node.lineno, col_offset=0)


def read_arrows(root: Path, sources: Mapping[str, str]) -> list[Arrow]:
    """Every arrow between two modules of the tree. An import of a name under one of the
    packages that is no module of the tree fails here: the check must see every import."""
    known = modules(root, sources)
    arrows: list[Arrow] = []
    for module, file in known.items():
        is_package = file.endswith("__init__.py")
        tree = ast.parse((root / file).read_text(), file)
        for statement, type_only, in_function in _imports([tree]):
            for target in _targets(module, is_package, statement, known):
                if target in known:
                    arrows.append(
                        Arrow(file, statement.lineno, known[target], type_only, in_function)
                    )
                elif any(target == p or target.startswith(p + ".") for p in sources):
                    raise LookupError(f"{file}:{statement.lineno} imports {target}: no such module")
    return arrows


def _targets(
    module: str, is_package: bool, statement: ast.Import | ast.ImportFrom, known: Mapping[str, str]
) -> list[str]:
    if isinstance(statement, ast.Import):
        return [alias.name for alias in statement.names]
    base = statement.module or ""
    if statement.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[: len(here) - (statement.level - 1)]
        base = ".".join([*here, *([statement.module] if statement.module else [])])
    # `from x import y` imports the module x.y if there is one, else a name of x.
    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in statement.names]
    return list(dict.fromkeys(targets))


# -- parts and layers --------------------------------------------------------------------


def part_of(file: str, stacks: Mapping[str, Sequence[Sequence[str]]]) -> str | None:
    """The part a file belongs to: the most specific one named (a folder holds its files,
    `_mcp*.py` the files it matches); None if no layer names it."""
    best: str | None = None
    for layers in stacks.values():
        for layer in layers:
            for part in layer:
                if _holds(part, file) and (best is None or len(part) > len(best)):
                    best = part
    return best


def _holds(part: str, file: str) -> bool:
    if part.endswith("/"):
        return file.startswith(part)
    return Path(file).match(part) and Path(file).parent == Path(part).parent


def _height(part: str, layers: Sequence[Sequence[str]]) -> int | None:
    for height, layer in enumerate(layers):
        if part in layer:
            return height
    return None


def _allowed(importer: str, imported: str, stacks: Mapping[str, Sequence[Sequence[str]]]) -> bool:
    """Whether some stack holds both parts with the imported one no higher."""
    for layers in stacks.values():
        high, low = _height(importer, layers), _height(imported, layers)
        if high is not None and low is not None and low <= high:
            return True
    return False


@dataclass(frozen=True)
class Graph:
    """The tree's arrows, each with the parts at its ends."""

    arrows: list[Arrow]
    stacks: Mapping[str, Sequence[Sequence[str]]]

    def parts(self, arrow: Arrow) -> tuple[str | None, str | None]:
        return part_of(arrow.file, self.stacks), part_of(arrow.target, self.stacks)

    def between_parts(self) -> Iterator[tuple[str, str, Arrow]]:
        for arrow in self.arrows:
            source, target = self.parts(arrow)
            if source is not None and target is not None and source != target:
                yield source, target, arrow

    def upward(self) -> list[str]:
        """Rule 1: each arrow to a part higher than its own, or outside its stack."""
        return [
            f"{arrow.file}:{arrow.line}  {source} -> {target}  ({arrow.how(arrow.target)})"
            for source, target, arrow in self.between_parts()
            if not _allowed(source, target, self.stacks)
        ]

    def mutual(self) -> list[str]:
        """Rule 2: each pair of parts that import each other, with the arrows both ways:
        first the way that runs up (the one to cut), else the way with fewer arrows."""
        ways: dict[tuple[str, str], list[Arrow]] = collections.defaultdict(list)
        for source, target, arrow in self.between_parts():
            ways[source, target].append(arrow)
        found = []
        for (a, b), there in sorted(ways.items()):
            if a < b and (back := ways.get((b, a))):
                up = not _allowed(a, b, self.stacks), not _allowed(b, a, self.stacks)
                if (up[1], -len(back)) > (up[0], -len(there)):
                    (a, there), (b, back) = (b, back), (a, there)
                found.append(
                    f"{a} <-> {b}:"
                    + "".join(f"\n      {x.where()}" for x in there)
                    + f"\n    and back ({len(back)}):"
                    + "".join(f"\n      {x.where()}" for x in back)
                )
        return found

    def circles(self) -> list[str]:
        """Rule 3: each set of files that import each other round (a strongly connected
        component of two or more), with the arrows that make it."""
        follows: dict[str, set[str]] = collections.defaultdict(set)
        for arrow in self.arrows:
            if arrow.file != arrow.target:
                follows[arrow.file].add(arrow.target)
        found = []
        for circle in _strongly_connected(follows):
            inside = sorted(
                a.where() for a in self.arrows if a.file in circle and a.target in circle
            )
            found.append(f"{len(circle)} files:" + "".join(f"\n      {x}" for x in inside))
        return found

    def unplaced(self, files: Iterable[str]) -> list[str]:
        """Files no layer names, and parts named that hold no file."""
        files = list(files)
        missing = [f"{file}: in no layer" for file in files if part_of(file, self.stacks) is None]
        named = {part for layers in self.stacks.values() for layer in layers for part in layer}
        stale = [
            f"{part}: holds no file"
            for part in sorted(named)
            if not any(_holds(part, f) for f in files)
        ]
        return missing + stale


def _strongly_connected(follows: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of two or more nodes, each sorted (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(follows):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(follows[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, nexts = work[-1]
            for nxt in nexts:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(follows.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def the_tree() -> Graph:
    return Graph(read_arrows(REPO, packages(REPO)), STACKS)


def _failing(rule: str, found: list[str]) -> str:
    return f"{len(found)} {rule} (issue 25, item 2):\n  " + "\n  ".join(found)


# -- the tree's rules --------------------------------------------------------------------


def test_every_module_stands_in_a_layer() -> None:
    """A module added outside every layer, or a layer naming what is gone, fails here, so
    the three rules below never pass by not seeing a part."""
    graph = the_tree()
    files = modules(REPO, packages(REPO)).values()
    assert graph.arrows, "no import read: the check reads the wrong tree"
    unplaced = graph.unplaced(files)
    assert not unplaced, _failing("files or parts out of the layers", unplaced)


def test_no_import_runs_up_a_layer() -> None:
    upward = the_tree().upward()
    assert not upward, _failing("imports run up a layer", upward)


def test_no_two_parts_import_each_other() -> None:
    mutual = the_tree().mutual()
    assert not mutual, _failing("pairs of parts import each other", mutual)


def test_no_files_import_each_other_in_a_circle() -> None:
    circles = the_tree().circles()
    assert not circles, _failing("circles of files", circles)


# -- the check itself can fail -----------------------------------------------------------

#: A package of three layers, bottom/ < middle/ < top.py, planted with one of each fault.
PLANTED = {
    "pkg/__init__.py": "",
    "pkg/bottom/__init__.py": "",
    "pkg/bottom/_base.py": "from typing import TYPE_CHECKING\n"
    "if TYPE_CHECKING:\n"
    "    from ..middle._mid import Mid\n",  # up, type-only
    "pkg/bottom/_leaf.py": "import os\n",
    "pkg/middle/__init__.py": "",
    "pkg/middle/_mid.py": "from ..bottom import _leaf\nclass Mid: ...\n"
    "def late() -> None:\n"
    "    from .. import top\n",  # up, in a function
    "pkg/middle/_one.py": "from . import _two\n",  # a circle of two files, in one part
    "pkg/middle/_two.py": "from ._one import *\n",
    "pkg/top.py": "from .middle import _mid\nimport pkg.bottom._base\n",
}
PLANTED_LAYERS = {"pkg": (("pkg/bottom/",), ("pkg/middle/",), ("pkg/top.py", "pkg/__init__.py"))}


def _planted(root: Path, files: Mapping[str, str]) -> Graph:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return Graph(read_arrows(root, {"pkg": "pkg"}), PLANTED_LAYERS)


def test_the_check_finds_each_planted_fault_and_where_it_is(tmp_path: Path) -> None:
    graph = _planted(tmp_path, PLANTED)
    assert graph.upward() == [
        "pkg/bottom/_base.py:3  pkg/bottom/ -> pkg/middle/  (pkg/middle/_mid.py, type-only)",
        "pkg/middle/_mid.py:4  pkg/middle/ -> pkg/top.py  (pkg/top.py, in a function)",
    ]
    assert graph.mutual() == [
        "pkg/bottom/ <-> pkg/middle/:"
        "\n      pkg/bottom/_base.py:3 -> pkg/middle/_mid.py, type-only"
        "\n    and back (1):"
        "\n      pkg/middle/_mid.py:1 -> pkg/bottom/_leaf.py",
        "pkg/middle/ <-> pkg/top.py:"
        "\n      pkg/middle/_mid.py:4 -> pkg/top.py, in a function"
        "\n    and back (1):"
        "\n      pkg/top.py:1 -> pkg/middle/_mid.py",
    ]
    assert graph.circles() == [
        "3 files:"
        "\n      pkg/bottom/_base.py:3 -> pkg/middle/_mid.py, type-only"
        "\n      pkg/middle/_mid.py:4 -> pkg/top.py, in a function"
        "\n      pkg/top.py:1 -> pkg/middle/_mid.py"
        "\n      pkg/top.py:2 -> pkg/bottom/_base.py",
        "2 files:"
        "\n      pkg/middle/_one.py:1 -> pkg/middle/_two.py"
        "\n      pkg/middle/_two.py:1 -> pkg/middle/_one.py",
    ]
    assert graph.unplaced(modules(tmp_path, {"pkg": "pkg"}).values()) == []


def test_the_check_passes_the_planted_package_once_its_faults_are_taken_out(tmp_path: Path) -> None:
    mended = PLANTED | {
        "pkg/bottom/_base.py": "from typing import TYPE_CHECKING\n",
        "pkg/middle/_mid.py": "from ..bottom import _leaf\nclass Mid: ...\n",
        "pkg/middle/_two.py": "import os\n",
    }
    graph = _planted(tmp_path, mended)
    assert (graph.upward(), graph.mutual(), graph.circles()) == ([], [], [])
    assert len(graph.arrows) == 4  # _mid -> _leaf, _one -> _two, top -> _mid, top -> _base


def test_the_check_refuses_an_import_it_cannot_place(tmp_path: Path) -> None:
    """An import of a module under the package that is not in the tree (a typo, a file
    the check did not find) is an error, never an arrow quietly left out."""
    with pytest.raises(LookupError, match=r"pkg/top.py:1 imports pkg.nowhere: no such module"):
        _planted(tmp_path, {"pkg/__init__.py": "", "pkg/top.py": "import pkg.nowhere\n"})


def test_a_part_named_for_nothing_or_a_file_in_no_layer_is_said(tmp_path: Path) -> None:
    graph = _planted(tmp_path, PLANTED | {"pkg/stray.py": ""})
    assert graph.unplaced(modules(tmp_path, {"pkg": "pkg"}).values()) == [
        "pkg/stray.py: in no layer"
    ]
    stale = Graph(graph.arrows, {"pkg": (*PLANTED_LAYERS["pkg"], ("pkg/gone/",))})
    assert stale.unplaced(modules(tmp_path, {"pkg": "pkg"}).values()) == [
        "pkg/stray.py: in no layer",
        "pkg/gone/: holds no file",
    ]


# -- the graph, printed ------------------------------------------------------------------


def print_graph(graph: Graph) -> None:
    counts = collections.Counter((s, t) for s, t, _ in graph.between_parts())
    print(f"{len(graph.arrows)} arrows; between two parts ({sum(counts.values())}):")
    for (source, target), count in sorted(counts.items()):
        flag = "" if _allowed(source, target, graph.stacks) else "   UP"
        print(f"  {source:26} -> {target:26} {count:3}{flag}")
    for rule, found in (
        ("imports run up a layer", graph.upward()),
        ("pairs of parts import each other", graph.mutual()),
        ("circles of files", graph.circles()),
    ):
        print(_failing(rule, found) if found else f"0 {rule}")


if __name__ == "__main__":
    print_graph(the_tree())
    sys.exit(0)
