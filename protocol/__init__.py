"""subagentd's wire protocol: framing, messages, errors and version. No I/O here.

The daemon and both clients import this package; it imports nothing of theirs.
"""

from ._framing import HEADER as HEADER
from ._framing import FrameDecoder as FrameDecoder
from ._framing import frame as frame
from ._messages import TERMINAL_STATES as TERMINAL_STATES
from ._messages import Abort as Abort
from ._messages import ClientMessage as ClientMessage
from ._messages import Collect as Collect
from ._messages import DaemonInfo as DaemonInfo
from ._messages import DaemonMessage as DaemonMessage
from ._messages import Done as Done
from ._messages import Entry as Entry
from ._messages import EntryKind as EntryKind
from ._messages import Error as Error
from ._messages import Hello as Hello
from ._messages import Info as Info
from ._messages import InfoReply as InfoReply
from ._messages import ListWorkers as ListWorkers
from ._messages import NewRun as NewRun
from ._messages import Page as Page
from ._messages import Reply as Reply
from ._messages import Request as Request
from ._messages import ResultReply as ResultReply
from ._messages import RunReply as RunReply
from ._messages import Spawn as Spawn
from ._messages import Status as Status
from ._messages import Stop as Stop
from ._messages import Stopped as Stopped
from ._messages import StopRun as StopRun
from ._messages import Wait as Wait
from ._messages import Watch as Watch
from ._messages import Welcome as Welcome
from ._messages import WorkerList as WorkerList
from ._messages import WorkerReply as WorkerReply
from ._messages import WorkerResult as WorkerResult
from ._messages import WorkerState as WorkerState
from ._messages import WorkerView as WorkerView
from ._messages import client_decoder as client_decoder
from ._messages import daemon_decoder as daemon_decoder
from ._messages import encode as encode
from ._paths import default_config_path as default_config_path
from ._paths import default_socket_path as default_socket_path
from ._paths import default_state_dir as default_state_dir
from ._version import DEFAULT_FRAME_LIMIT as DEFAULT_FRAME_LIMIT
from ._version import PROTOCOL_VERSION as PROTOCOL_VERSION
from ._version import package_version as package_version
