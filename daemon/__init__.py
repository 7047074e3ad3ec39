"""subagentd's daemon: the registry, worker processes, journals and the control server,
grouped as core/ (pure), store/, processes/, workers/, serving/ and lifecycle/
(docs/design.md draws the tree).

Nothing imports this package but its own entry points (`subagentd`, and
`python -m subagentd.daemon`, which a reload runs); clients speak the protocol
over the socket. Importing it stays light: `--check` runs on a reload's path.
"""

from ._main import main as main
