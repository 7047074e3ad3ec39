"""The OS side of a worker: the launcher port, processes, trees, cgroups."""
