"""`python -m subagentd.daemon`: how a reload runs the image installed now."""

from ._main import main

raise SystemExit(main())
