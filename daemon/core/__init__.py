"""The pure core: decisions on workers, runs, wakes, permissions, connections; no I/O."""
