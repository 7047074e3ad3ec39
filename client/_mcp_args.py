"""subagentd-mcp's tool arguments: what each tool takes, bounded as the daemon bounds it.

Every argument model forbids properties it does not name, so a misspelt or unknown
argument is refused instead of dropped, and carries the daemon's own limits (imported from
protocol/_messages.py, never restated), so the input schema a host shows its model is the
check the daemon makes. A refusal of the arguments reads as the daemon's do:
``invalid: <field>: <why>``. Pure: no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
)

from subagentd.protocol import (
    MAX_ARG_BYTES,
    MAX_ARGS,
    MAX_BACKOFF,
    MAX_CONTEXT_LINES,
    MAX_CPUS,
    MAX_EPOCH,
    MAX_GRACE,
    MAX_GREP_MATCHES,
    MAX_ID_LENGTH,
    MAX_INPUT_BYTES,
    MAX_INT,
    MAX_KEY_LENGTH,
    MAX_NAME_LENGTH,
    MAX_PATH_LENGTH,
    MAX_PATTERN_LENGTH,
    MAX_PIDS,
    MAX_PRIORITY,
    MAX_RETRIES,
    MAX_RUNNING,
    MAX_SEND_BYTES,
    MAX_TIMEOUT,
    MIN_CPUS,
    LimitError,
    cores,
    memory_bytes,
    process_count,
)

from ._when import MAX_SINCE_LENGTH, parse_since

#: The longest one tool call may be asked to wait. A host gives up on a call long before
#: (the TypeScript SDK after 60 s): the descriptions ask for short waits, called again.
MAX_TOOL_WAIT = 3600.0
#: What a wait waits when not told: well inside a host's usual 60 s.
DEFAULT_TOOL_WAIT = 30.0
#: The bytes of output one answer carries by default, and at most (text and structured
#: content each): what a model can read at once, and far below the frame limit.
DEFAULT_MAX_BYTES = 32 * 1024
MIN_MAX_BYTES = 1024
MAX_MAX_BYTES = 1024 * 1024
#: Entries of one watch page at most, and lines of a tail: what a model can read at once.
MAX_PAGE = 1000
#: A description a host shows for every wait argument: why to keep it short.
WAIT_ADVICE = (
    "keep it short (under 50 s: a host gives up on a call after its own timeout, often "
    "60 s) and call again to wait longer"
)


class Invalid(Exception):
    """Arguments this server refuses: ``invalid: <field>: <why>``, as the daemon says it."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field
        self.why = why


def _utf8_within(limit: int) -> Any:
    def check(text: str | None) -> str | None:
        if text is not None and len(text.encode("utf-8", errors="surrogatepass")) > limit:
            raise ValueError(f"at most {limit} bytes as UTF-8")
        return text

    return AfterValidator(check)


def _since_checked(text: str | None) -> str | None:
    # Its words checked here (a duration as if said at the latest time there is); the
    # time it names is found, and checked again, when the call runs (`since_of`).
    if text is not None:
        parse_since(text, MAX_EPOCH)
    return text


def since_of(text: str | None, now: float) -> float | None:
    """The time a `since` argument names, said at `now`; Invalid if it is out of reach."""
    if text is None:
        return None
    try:
        return parse_since(text, now)
    except ValueError as exc:
        raise Invalid("since", str(exc)) from None


def _bounded_text(text: str | None) -> str | None:
    # A string where a time is asked: checked before it is parsed, never huge.
    if isinstance(text, str) and len(text) > MAX_SINCE_LENGTH:
        raise ValueError(f"at most {MAX_SINCE_LENGTH} characters")
    return text


# -- the values, each with the daemon's bound ----------------------------------------------

WorkerId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        description="a worker id, as subagent_spawn or subagent_list gave it",
    ),
]
RunId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        description="a run id, as subagent_spawn or subagent_list gave it",
    ),
]
Pattern = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_PATTERN_LENGTH,
        description="a regular expression in RE2 syntax (no backreferences or lookaround), "
        "matched against each line of output",
    ),
]
ToolWait = Annotated[
    float,
    Field(ge=0, le=MAX_TOOL_WAIT, allow_inf_nan=False),
]
MaxBytes = Annotated[
    int,
    Field(
        ge=MIN_MAX_BYTES,
        le=MAX_MAX_BYTES,
        description="the bytes of output this answer carries at most (its text, and the "
        "output in its structured content, each); what is cut says how to read on",
    ),
]
Since = Annotated[
    str | None,
    BeforeValidator(_bounded_text),
    AfterValidator(_since_checked),
    Field(
        description="only output written since then: a duration ago (10m, 90s, 2h, 1h30m), "
        "an ISO 8601 time (UTC unless it names its offset), or seconds since the epoch"
    ),
]
Stream = Annotated[
    Literal["stdout", "stderr"] | None,
    Field(description="only this stream of its output (default: both)"),
]


def _limit(read: Any) -> Any:
    """A limit as people write it ("2G", 1.5, 100), read by the parser every door shares."""

    def check(value: object) -> object:
        if value is None:
            return None
        try:
            return read(value)
        except LimitError as exc:
            raise ValueError(str(exc).split(": ", 1)[1]) from None

    return BeforeValidator(check)


class Arguments(BaseModel):
    """A tool's arguments: strict JSON types, no property it does not name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    def waits(self) -> float | None:
        """The seconds this call may wait at most, said in its progress; None: not known."""
        return None


class SpawnArguments(Arguments):
    argv: Annotated[
        list[Annotated[str, Field(max_length=MAX_ARG_BYTES)]] | None,
        Field(
            max_length=MAX_ARGS,
            description='the command and its arguments, e.g. ["pytest", "-x"]',
        ),
    ] = None
    agent: Annotated[
        str | None,
        Field(
            max_length=MAX_NAME_LENGTH,
            description="an agent named in the user's agents.toml, instead of argv",
        ),
    ] = None
    name: Annotated[
        str, Field(max_length=MAX_NAME_LENGTH, description="a name to tell the worker by")
    ] = ""
    cwd: Annotated[
        str | None,
        Field(
            max_length=MAX_PATH_LENGTH, description="its working directory (default: this server's)"
        ),
    ] = None
    env: Annotated[
        dict[
            Annotated[str, Field(min_length=1, max_length=MAX_ARG_BYTES)],
            Annotated[str, Field(max_length=MAX_ARG_BYTES)],
        ],
        Field(
            max_length=MAX_ARGS,
            description="environment variables set for it, over the daemon's own",
        ),
    ] = {}
    input: Annotated[
        str | None,
        _utf8_within(MAX_INPUT_BYTES),
        Field(max_length=MAX_INPUT_BYTES, description="text given on its stdin"),
    ] = None
    timeout: Annotated[
        float | None,
        Field(
            ge=0,
            le=MAX_TIMEOUT,
            allow_inf_nan=False,
            description="seconds before the daemon stops it as timed out (0 or absent: never)",
        ),
    ] = None
    grace: Annotated[
        float | None,
        Field(
            ge=0,
            le=MAX_GRACE,
            allow_inf_nan=False,
            description="seconds between TERM and KILL when it is stopped (default: the "
            "daemon's, or its agent's)",
        ),
    ] = None
    key: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=MAX_KEY_LENGTH,
            pattern=r"^[!-~]+$",
            description="an idempotency key of your choosing (printable ASCII, no space): "
            "a spawn sent again with the same key answers the worker the first one made",
        ),
    ] = None
    run: Annotated[
        str | None,
        Field(
            max_length=MAX_ID_LENGTH,
            description="an existing run to start it in, e.g. one subagent_new_run made with "
            "a cap on its workers running at once (default: a new run, with no cap)",
        ),
    ] = None
    stdin_open: Annotated[
        bool, Field(description="keep its stdin open, for subagent_send to write to")
    ] = False
    memory: Annotated[
        int | str | None,
        _limit(memory_bytes),
        Field(
            description="what it and every worker it delegates may hold in memory together: "
            'bytes, or "512M", "1.5G", "2GiB" (1M to 1P); past it the kernel kills in it, '
            'and a worker so killed ends failed with reason "memory_limit"'
        ),
    ] = None
    cpus: Annotated[
        float | int | str | None,
        _limit(cores),
        Field(
            description=f"the cores of CPU it and its delegates may use together "
            f"({MIN_CPUS} to {MAX_CPUS:g}, e.g. 1.5)"
        ),
    ] = None
    pids: Annotated[
        int | str | None,
        _limit(process_count),
        Field(
            description=f"the processes it and its delegates may have at once (1 to "
            f"{MAX_PIDS}); a fork past it fails"
        ),
    ] = None
    priority: Annotated[
        int,
        Field(
            ge=-MAX_PRIORITY,
            le=MAX_PRIORITY,
            description="over a cap on workers running at once (its run's, its agent's, the "
            "daemon's), where it waits in the queue: higher first, then first in",
        ),
    ] = 0
    after: Annotated[
        list[Annotated[str, Field(max_length=MAX_ID_LENGTH)]],
        Field(max_length=64, description="start it once these workers have all ended"),
    ] = []
    after_ok: Annotated[
        list[Annotated[str, Field(max_length=MAX_ID_LENGTH)]],
        Field(
            max_length=64,
            description="start it once these have all finished with exit 0; else it ends "
            'stopped, reason "skipped", naming which did not',
        ),
    ] = []
    after_ready: Annotated[
        list[Annotated[str, Field(max_length=MAX_ID_LENGTH)]],
        Field(max_length=64, description="start it once these are all ready"),
    ] = []
    retries: Annotated[
        int,
        Field(
            ge=0,
            le=MAX_RETRIES,
            description="when it ends failed (a non-zero exit, or memory_limit), start it "
            "again up to this many times (the same id, from its snapshot) after `backoff`; "
            "its parent is woken once, by the last attempt; a stop ends the retries",
        ),
    ] = 0
    backoff: Annotated[
        float,
        Field(
            ge=0,
            le=MAX_BACKOFF,
            allow_inf_nan=False,
            description="seconds before the first retry, doubling each time",
        ),
    ] = 1.0
    backoff_max: Annotated[
        float | None,
        Field(
            ge=0,
            le=MAX_BACKOFF,
            allow_inf_nan=False,
            description="the most seconds a retry's backoff grows to (default: a day)",
        ),
    ] = None
    retry_on: Annotated[
        list[Literal["timeout"]],
        Field(max_length=1, description='["timeout"]: retry a worker that timed out too'),
    ] = []
    ready: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=MAX_PATTERN_LENGTH,
            description="wait, in this same call, until a line of its output matches this "
            "regular expression (RE2 syntax), e.g. 'listening on'; the answer's `ready` says "
            "whether it matched, or gives how it ended and its output's tail",
        ),
    ] = None
    ready_timeout: Annotated[
        ToolWait, Field(description=f"with ready: seconds to wait at most; {WAIT_ADVICE}")
    ] = DEFAULT_TOOL_WAIT
    max_bytes: MaxBytes = DEFAULT_MAX_BYTES

    def waits(self) -> float | None:
        return None if self.ready is None else self.ready_timeout


class NewRunArguments(Arguments):
    max_running: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_RUNNING,
            description="run at most this many of its workers at once: a spawn into it over "
            "the cap is answered at once, queued (its `queue_position` says where), and "
            "starts as one of them ends, first in first out (or by the spawn's `priority`); "
            "a stop of the run ends the queued ones unstarted (absent: no cap)",
        ),
    ] = None
    outer: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=MAX_ID_LENGTH,
            description="nest it under this run: stopping that run stops this one too, and "
            "its limits bound this one's",
        ),
    ] = None
    memory: Annotated[
        int | str | None,
        _limit(memory_bytes),
        Field(
            description='what the run\'s workers may hold in memory together: bytes, or "512M", '
            '"1.5G", "2GiB" (1M to 1P)'
        ),
    ] = None
    cpus: Annotated[
        float | int | str | None,
        _limit(cores),
        Field(
            description=f"the cores of CPU the run's workers may use together ({MIN_CPUS} to "
            f"{MAX_CPUS:g}, e.g. 1.5)"
        ),
    ] = None
    pids: Annotated[
        int | str | None,
        _limit(process_count),
        Field(description=f"the processes the run's workers may have at once (1 to {MAX_PIDS})"),
    ] = None


class ListArguments(Arguments):
    all: Annotated[bool, Field(description="include ended workers the daemon retains")] = False
    run: Annotated[
        str | None, Field(max_length=MAX_ID_LENGTH, description="only the workers of this run")
    ] = None
    cursor: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=MAX_NAME_LENGTH,
            description="list the workers after this place: a previous answer's `next`",
        ),
    ] = None
    max_bytes: MaxBytes = DEFAULT_MAX_BYTES


class StatusArguments(Arguments):
    worker: WorkerId
    max_bytes: MaxBytes = DEFAULT_MAX_BYTES


class WatchArguments(Arguments):
    worker: WorkerId
    cursor: Annotated[
        int | None,
        Field(
            ge=0,
            le=MAX_INT,
            description="read the entries after this cursor (0, or absent: from the start): "
            "a previous answer's `next`",
        ),
    ] = None
    offset: Annotated[
        int,
        Field(
            ge=0,
            le=MAX_INT,
            description="bytes of the entry after `cursor` already read: a cut answer's "
            "`offset`, to read that entry on from there",
        ),
    ] = 0
    last: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_PAGE,
            description="instead: the last N lines of its output",
        ),
    ] = None
    since: Since = None
    stream: Stream = None
    limit: Annotated[int, Field(ge=1, le=MAX_PAGE, description="entries per page")] = 200
    max_bytes: MaxBytes = DEFAULT_MAX_BYTES


class GrepArguments(Arguments):
    worker: WorkerId
    pattern: Pattern
    before: Annotated[
        int, Field(ge=0, le=MAX_CONTEXT_LINES, description="lines of context before each match")
    ] = 0
    after: Annotated[
        int, Field(ge=0, le=MAX_CONTEXT_LINES, description="lines of context after each match")
    ] = 0
    limit: Annotated[int, Field(ge=1, le=MAX_GREP_MATCHES, description="matches at most")] = 100
    cursor: Annotated[
        int | None,
        Field(
            ge=0,
            le=MAX_INT,
            description="only matches on lines after this line number: a previous answer's "
            "`next` (0, or absent: from the start)",
        ),
    ] = None
    since: Since = None
    stream: Stream = None
    max_bytes: MaxBytes = DEFAULT_MAX_BYTES


class WaitArguments(Arguments):
    worker: WorkerId
    timeout: Annotated[
        ToolWait,
        Field(description=f"seconds to wait at most, then the outcome is timed_out; {WAIT_ADVICE}"),
    ] = DEFAULT_TOOL_WAIT
    pattern: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=MAX_PATTERN_LENGTH,
            description="instead of its end, wait for a line of its output matching this "
            "regular expression (RE2 syntax); lines already written count",
        ),
    ] = None
    ready: Annotated[
        bool,
        Field(
            description="instead of its end, wait until it is ready (the `ready` pattern it "
            "was spawned with matched): outcome matched; ended if it ended first",
        ),
    ] = False

    def waits(self) -> float | None:
        return self.timeout


class SendArguments(Arguments):
    worker: WorkerId
    text: Annotated[
        str,
        _utf8_within(MAX_SEND_BYTES),
        Field(
            max_length=MAX_SEND_BYTES,
            description="what to write to its stdin (end it with \\n for a line)",
        ),
    ]
    eof: Annotated[bool, Field(description="close its stdin after writing")] = False


class StopArguments(Arguments):
    worker: WorkerId
    wait: Annotated[bool, Field(description="return once its processes are gone")] = True


class StopRunArguments(Arguments):
    run: RunId
    wait: Annotated[bool, Field(description="return once its processes are gone")] = True


class CancelArguments(Arguments):
    scope: Annotated[
        str,
        Field(
            min_length=1,
            max_length=MAX_NAME_LENGTH,
            description="`worker:W` (W and its subtree), `run:R` (R and its nested runs), "
            "`turn:G` (the workers of turn G) or `all`",
        ),
    ]


class PauseArguments(Arguments):
    worker: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=MAX_ID_LENGTH,
            description="a worker: it and every worker it delegated to",
        ),
    ] = None
    run: Annotated[
        str | None,
        Field(min_length=1, max_length=MAX_ID_LENGTH, description="instead: a run's workers"),
    ] = None


class WorkerPauseArguments(Arguments):
    """subagent_pause's and subagent_unpause's arguments inside a worker, which may pause
    a worker of its subtree but never a run: no `run`."""

    worker: Annotated[
        str,
        Field(
            min_length=1,
            max_length=MAX_ID_LENGTH,
            description="a worker of your subtree: it and every worker it delegated to",
        ),
    ]


class CollectArguments(Arguments):
    worker: WorkerId
    wait: Annotated[bool, Field(description="wait for it to end first")] = False
    timeout: Annotated[
        ToolWait,
        Field(description=f"with wait: seconds to wait at most (then timed_out); {WAIT_ADVICE}"),
    ] = DEFAULT_TOOL_WAIT
    max_bytes: MaxBytes = DEFAULT_MAX_BYTES

    def waits(self) -> float | None:
        return self.timeout if self.wait else None


class EventsArguments(Arguments):
    run: Annotated[
        str | None,
        Field(max_length=MAX_ID_LENGTH, description="the wakes of this run's top-level workers"),
    ] = None
    worker: Annotated[
        str | None,
        Field(
            max_length=MAX_ID_LENGTH,
            description="the wakes of the workers this worker delegated to (default inside "
            "a worker: its own)",
        ),
    ] = None
    timeout: Annotated[
        ToolWait,
        Field(
            description=f"if none is pending, wait this long for one (0: do not wait); "
            f"{WAIT_ADVICE}"
        ),
    ] = 0.0
    max_bytes: MaxBytes = DEFAULT_MAX_BYTES

    def waits(self) -> float | None:
        return self.timeout


#: A resumed worker's new time limit (only it may be given again).
NewTimeLimit = Annotated[
    float | None,
    Field(
        ge=0,
        le=MAX_TIMEOUT,
        allow_inf_nan=False,
        description="a new time limit for the worker, in seconds (0: none)",
    ),
]


class ResumeArguments(Arguments):
    worker: Annotated[
        str | None,
        Field(max_length=MAX_ID_LENGTH, description="an ended (not finished) worker to carry on"),
    ] = None
    run: Annotated[
        str | None,
        Field(
            max_length=MAX_ID_LENGTH,
            description="instead: a run, whose unfinished workers carry on",
        ),
    ] = None
    timeout: NewTimeLimit = None


class WorkerResumeArguments(Arguments):
    """subagent_resume's arguments inside a worker, which may resume a worker of its
    subtree but never a run (the daemon refuses a worker's resume_run): no `run`."""

    worker: Annotated[
        str,
        Field(
            min_length=1,
            max_length=MAX_ID_LENGTH,
            description="an ended (not finished) worker of your subtree to carry on",
        ),
    ]
    timeout: NewTimeLimit = None


class RestartArguments(Arguments):
    worker: WorkerId
    timeout: Annotated[
        float | None,
        Field(
            ge=0,
            le=MAX_TIMEOUT,
            allow_inf_nan=False,
            description="a new time limit for its new attempt, in seconds (0: none)",
        ),
    ] = None
    wait_timeout: Annotated[
        ToolWait,
        Field(
            description="seconds to wait at most for the stop to finish (a worker's grace "
            f"may be long); past it the stop goes on and you call again; {WAIT_ADVICE}"
        ),
    ] = DEFAULT_TOOL_WAIT

    def waits(self) -> float | None:
        return self.wait_timeout


class LatestArguments(Arguments):
    cwd: Annotated[
        str | None,
        Field(max_length=MAX_PATH_LENGTH, description="the directory (default: this server's)"),
    ] = None


A = TypeVar("A", bound=Arguments)


def checked(model: type[A], arguments: dict[str, Any]) -> A:
    """`arguments` as `model` takes them, or Invalid naming the first field at fault."""
    try:
        return model.model_validate(arguments)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> Invalid:
    error = exc.errors(include_url=False, include_input=False)[0]
    field = ".".join(str(part) for part in error["loc"]) or "arguments"
    kind, why = error["type"], error["msg"]
    if kind == "extra_forbidden":
        why = "not an argument of this tool"
    elif kind == "missing":
        why = "required"
    elif kind == "value_error":
        why = why.removeprefix("Value error, ")
    return Invalid(field, why[:1].lower() + why[1:])
