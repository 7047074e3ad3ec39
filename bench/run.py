"""Run every benchmark, side by side with supervisord, and write the results.

    .venv/bin/python bench/run.py [--quick] [--only NAME ...] [--many N] [--out DIR]

(`make bench` installs supervisor into the venv and runs this.) Each bench
module's `measure()` starts its own private daemons in temporary dirs and
returns its figures; this writes them all to DIR/<YYYY-MM-DD>.md and .json
(the machine, the versions, each figure's median, p99 and spread) and prints
the table. `--quick` runs every bench with small sizes, to try the harness
(its results are written with a `-quick` suffix and prove nothing). `--many N`
sizes many.py (live workers, and `true` workers collected; default 10,000).

Other work on the machine shows in the figures: the load average before and
after is written down, and every figure is a median with its spread.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from _harness import Figure, number, table

HERE = Path(__file__).resolve().parent

#: (module, keyword arguments of its measure()): the full run, and --quick.
BENCHES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("roundtrip", {"calls": 10_000, "clients": 8, "seconds": 3.0, "rounds": 3},
     {"calls": 1000, "clients": 8, "seconds": 0.5, "rounds": 1}),
    ("start", {"starts": 100}, {"starts": 10}),
    ("limits_start", {"starts": 100}, {"starts": 10}),
    ("stop", {"stops": 100, "run_size": 100, "rounds": 10},
     {"stops": 10, "run_size": 10, "rounds": 1}),
    ("reload", {"workers": (0, 100, 1000), "runs": 5}, {"workers": (0, 20), "runs": 1}),
    ("journal", {"mib": 256, "runs": 5}, {"mib": 16, "runs": 1}),
    ("scale", {"workers": 1000, "seconds": 10}, {"workers": 50, "seconds": 2}),
    ("collect", {"workers": 1000, "rounds": 3}, {"workers": 50, "rounds": 1}),
    ("followers", {"idle": 200, "reading": 50, "mib": 100, "seconds": 4},
     {"idle": 20, "reading": 5, "mib": 8, "seconds": 1}),
    ("many", {"workers": 10_000, "collect": 10_000, "lists": 5, "reloads": 3},
     {"workers": 100, "collect": 100, "lists": 2, "reloads": 1}),
    ("retention", {"workers": 10_000}, {"workers": 100}),
    ("files", {"repeats": 5, "long_mib": 2}, {"repeats": 1, "long_mib": 2}),
    ("pause", {"sleepers": 100, "rounds": 20}, {"sleepers": 10, "rounds": 2}),
    ("usage", {"workers": 1000, "seconds": 10, "rounds": 3},
     {"workers": 50, "seconds": 2, "rounds": 1}),
    ("schedule", {"workers": 10_000}, {"workers": 200}),
]  # fmt: skip


def load() -> str:
    """The load average over 1, 5 and 15 minutes."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def machine() -> dict[str, Any]:
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        memory = int(f.readline().split()[1]) * 1024
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(memory / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "fd_limit": os.sysconf("SC_OPEN_MAX"),
    }


def measured_tree() -> str:
    """A hash of the code measured: every file under daemon/, protocol/ and client/ as it
    is on disk now (committed or not)."""
    digest = hashlib.sha256()
    for folder in ("daemon", "protocol", "client"):
        for path in sorted((HERE.parent / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(HERE.parent)).encode() + b"\0")
                digest.update(path.read_bytes())
    return digest.hexdigest()


def versions() -> dict[str, Any]:
    return {
        "subagentd": importlib.metadata.version("subagentd"),
        "supervisor": importlib.metadata.version("supervisor"),
        "trio": importlib.metadata.version("trio"),
        "msgspec": importlib.metadata.version("msgspec"),
        "commit": git("rev-parse", "--short", "HEAD"),
        # The daemon measured is the working tree, edits and all: say which were there.
        "uncommitted": [
            line.strip()
            for line in git(
                "status", "--porcelain", "--", "../daemon", "../protocol", "../client"
            ).splitlines()
        ],
    }


def split(figures: list[Figure]) -> tuple[list[Figure], str]:
    """The figures of the main table, and the files bench's own table (operations down,
    counts across) if it ran: its counts have no supervisord side to compare."""
    counted = [f for f in figures if f.bench == "files"]
    rest = [f for f in figures if f.bench != "files"]
    return rest, importlib.import_module("files").table(counted) if counted else ""


def measured(f: Figure) -> str:
    """What a missed target's figure came to: its median, ratio and times the floor."""
    parts = [f"median {number(f.subagentd['median'])} {f.unit}" if f.subagentd else ""]
    if f.ratio is not None:
        parts.append(f"{number(f.ratio)}x supervisord's")
    if f.floor_ratio is not None:
        parts.append(f"{number(f.floor_ratio)}x the floor")
    return ", ".join(p for p in parts if p)


def markdown(result: dict[str, Any], figures: list[Figure]) -> str:
    m, v = result["machine"], result["versions"]
    missed = [f for f in figures if f.met is False]
    main_figures, files_table = split(figures)
    lines = [
        f"# subagentd benchmarks, {result['date']}",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, Linux {m['kernel']}, "
        f"Python {m['python']}. subagentd {v['subagentd']} at {v['commit']}"
        + (f" with uncommitted changes ({'; '.join(v['uncommitted'])})" if v["uncommitted"] else "")
        + f"; supervisor {v['supervisor']} (PyPI), trio {v['trio']}, msgspec {v['msgspec']}."
        + (
            " **The daemon, protocol or client code changed during the run: the figures "
            "mix two builds.**"
            if result["code_changed_during_run"]
            else ""
        ),
        "",
        f"Run took {result['duration_s']:.0f} s; load average (1 / 5 / 15 min) "
        f"{result['load_before']} before, {result['load_after']} after. The machine was "
        "shared with other work during the run: every figure is a median (with its p99 and "
        "its spread, p90 - p10) and should be read as such.",
        "",
        "Each cell: median / p99 / spread (one number when there was one sample). Ratio: how "
        "many times better subagentd is than supervisord, on the medians. x floor: how many "
        "times the cost of the floor measured in the same run subagentd's median is (for a "
        "rate, the ceiling's over ours); a floor's own row has its figures in the first "
        "column. Targets are reported, not asserted.",
        "",
        *([table(main_figures), ""] if main_figures else []),
        *(
            [
                "## Files and directories per operation (state dir, counted by strace)",
                "",
                files_table,
                "",
            ]
            if files_table
            else []
        ),
        "## Notes",
        "",
        *[f"- {f.what}: {f.note}" for f in figures if f.note],
        "",
        "## Repetitions",
        "",
        *[f"- {name}: {json.dumps(kw)}" for name, kw in result["parameters"].items()],
        "",
        "## Targets missed",
        "",
        *([f"- {f.what}: {f.target} (here: {measured(f)})" for f in missed] or ["None."]),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes: try the harness")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these benches only")
    parser.add_argument(
        "--many", type=int, metavar="N", help="many.py's live and collected workers"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    chosen = [b for b in BENCHES if not args.only or b[0] in args.only]
    if args.only and len(chosen) != len(args.only):
        parser.error(f"benches are: {', '.join(b[0] for b in BENCHES)}")

    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y-%m-%d"),
        "started_at": datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": machine(),
        "versions": versions(),
        "load_before": load(),
        "parameters": {},
    }
    figures: list[Figure] = []
    tree = measured_tree()
    began = time.perf_counter()
    for name, full, quick in chosen:
        kwargs = quick if args.quick else full
        if name == "many" and args.many is not None:
            kwargs = kwargs | {"workers": args.many, "collect": args.many}
        print(f"== {name} {json.dumps(kwargs)}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        module = importlib.import_module(name)
        for figure in module.measure(**kwargs):
            figure.bench = name
            figures.append(figure)
        result["parameters"][name] = kwargs
        print(f"   {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    result["duration_s"] = round(time.perf_counter() - began, 1)
    result["load_after"] = load()
    # Others may commit to daemon/ while this runs: then the figures mix two builds.
    result["code_changed_during_run"] = measured_tree() != tree
    result["versions"]["code_sha256"] = tree
    if result["code_changed_during_run"]:
        print("warning: daemon/, protocol/ or client/ changed during the run", file=sys.stderr)
    result["figures"] = [f.to_json() for f in figures]

    args.out.mkdir(parents=True, exist_ok=True)
    stem = result["date"] + ("-quick" if args.quick else "") + ("-partial" if args.only else "")
    # A second full run the same day is kept beside the first, not written over it.
    base, n = stem, 1
    while (args.out / f"{stem}.json").exists():
        n += 1
        stem = f"{base}-{n}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result, figures))
    main_figures, files_table = split(figures)
    print("\n\n".join(t for t in (table(main_figures) if main_figures else "", files_table) if t))
    print(f"\nwritten: {args.out / stem}.md and .json ({result['duration_s']:.0f} s)")


if __name__ == "__main__":
    main()
