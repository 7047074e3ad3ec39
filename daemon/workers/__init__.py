"""The daemon's parts on trio: spawn, supervise, stop, read, wake, end and retain workers; runs."""
