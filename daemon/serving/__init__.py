"""The control socket: binding it, each connection's trio shell, sd_notify."""
