"""subagentd's daemon: the registry, worker processes, journals and the control server.

Nothing imports this package but its own entry point; clients speak the
protocol over the socket.
"""

from ._daemon import Daemon as Daemon
from ._main import main as main
