"""The daemon's parts on trio: supervise, read, wake, end and retain workers."""
