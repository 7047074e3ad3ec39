"""Clients of subagentd: `Client` (blocking) and `AsyncClient` (trio), each with its stop
switch (`BlockingStopSwitch`, `StopSwitch`), and the `subagentctl` CLI.

Both clients find the daemon as the CLI does and speak the protocol of
`subagentd.protocol`; the values they return and the errors they raise are
re-exported here, so one import serves a caller.
"""

from subagentd.protocol import TERMINAL_STATES as TERMINAL_STATES
from subagentd.protocol import DaemonInfo as DaemonInfo
from subagentd.protocol import Entry as Entry
from subagentd.protocol import EntryKind as EntryKind
from subagentd.protocol import GrepMatch as GrepMatch
from subagentd.protocol import GrepResult as GrepResult
from subagentd.protocol import Page as Page
from subagentd.protocol import ResumableRun as ResumableRun
from subagentd.protocol import Resumed as Resumed
from subagentd.protocol import Usage as Usage
from subagentd.protocol import WaitForResult as WaitForResult
from subagentd.protocol import Wake as Wake
from subagentd.protocol import WorkerResult as WorkerResult
from subagentd.protocol import WorkerState as WorkerState
from subagentd.protocol import WorkerView as WorkerView
from subagentd.protocol.errors import Busy as Busy
from subagentd.protocol.errors import ConnectionLost as ConnectionLost
from subagentd.protocol.errors import DaemonUnavailable as DaemonUnavailable
from subagentd.protocol.errors import ErrorCode as ErrorCode
from subagentd.protocol.errors import Forbidden as Forbidden
from subagentd.protocol.errors import FrameTooLarge as FrameTooLarge
from subagentd.protocol.errors import Frozen as Frozen
from subagentd.protocol.errors import Internal as Internal
from subagentd.protocol.errors import Invalid as Invalid
from subagentd.protocol.errors import NotFound as NotFound
from subagentd.protocol.errors import ProtocolError as ProtocolError
from subagentd.protocol.errors import Recovering as Recovering
from subagentd.protocol.errors import Refused as Refused
from subagentd.protocol.errors import Reloading as Reloading
from subagentd.protocol.errors import RemoteError as RemoteError
from subagentd.protocol.errors import RunStopped as RunStopped
from subagentd.protocol.errors import SubagentdError as SubagentdError
from subagentd.protocol.errors import TooLarge as TooLarge
from subagentd.protocol.errors import TransportError as TransportError
from subagentd.protocol.errors import UnsupportedVersion as UnsupportedVersion

from ._async import AsyncClient as AsyncClient
from ._switch import BlockingStopSwitch as BlockingStopSwitch
from ._switch import StopSwitch as StopSwitch
from ._sync import Client as Client
