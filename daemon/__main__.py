"""`python -m subagentd.daemon`: how a reload runs the image installed now."""

import gc

# A reload's new image (and its --check child) imports, adopts and starts supervising
# thousands of objects that all live on: a collection on the way finds no garbage and
# costs the reload time while clients wait. `serve` turns collection on once serving
# (what start-up made kept out of its sight a while: `_serve._collect_from_now_on`).
gc.disable()

from ._main import main  # noqa: E402  after the collector is off: imports allocate most

raise SystemExit(main())
