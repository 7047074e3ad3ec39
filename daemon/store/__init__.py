"""What the daemon keeps on disk: the sqlite store, archives, journals, the state dir."""
