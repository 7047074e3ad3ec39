"""The daemon's life across images: serve, reload in place, recover, resume."""
