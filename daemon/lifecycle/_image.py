"""Is the image on disk the very image running? If so, a reload's `--check` child (a
whole interpreter start and the imports, about 300 ms) would prove nothing this
process does not: the same code would read the same checkpoint format and store
schema. The reload then checks in place what can change without the code changing
(the config and the state dir) and skips the child.

The image is every file this process runs or may yet import: the interpreter, the
file of each module imported, and every module file of subagentd's own packages
(one not imported yet is one the next image may import at its start). Each file is
known by its stamp, (device, inode, size, mtime, ctime), following links as an
import does (a strict editable install is a tree of links to the sources).

The image on disk is the one running when every file's stamp is what it was when
the image began serving (`RunningImage.stamped`, when the reloader is made): a file
replaced by a new release (a new inode), edited in place (size, mtime), touched, or
a link or directory swapped to another release, older or not (another inode), is a
changed image. A module imported after that (a lazy import) has no stamp to compare:
its file must be older than the stamps (its ctime, which no call sets back), so what
it imported then is what is there now.

What this cannot see: a file changed after this image imported it and before the
stamps were taken, while the image was starting (a release installed during the
start itself); or a change hidden by the clock stepped back between it and the
reload. The new image is then exec'd unchecked; one that cannot start exits as
after a crash, and the next start recovers every worker.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

#: File times come from a coarse clock, behind the one read here by up to a tick:
#: a file imported later must be this much older than the stamps to be trusted.
CLOCK_SLACK_NS = 1_000_000_000
#: subagentd's own packages: each module file in them is part of the image.
OWN_PACKAGES = ("subagentd.daemon", "subagentd.protocol")

#: (device, inode, size, mtime, ctime) in ns; None: no such file (then).
Stamp = tuple[int, int, int, int, int] | None


@dataclass(frozen=True)
class RunningImage:
    """The files of the image running, stamped when it began serving."""

    stamps: dict[str, Stamp]
    #: When they were taken (ns, the wall clock).
    taken_ns: int

    @classmethod
    def stamped(cls) -> RunningImage:
        """The image's files as they are on disk now."""
        taken_ns = time.time_ns()
        return cls({path: _stamp(path) for path in _image_files()}, taken_ns)

    def changed_on_disk(self) -> str | None:
        """What on disk may differ from the image running (the first file found that
        says so), or None if it is the very image."""
        for path in sorted(set(self.stamps) | _image_files()):
            now = _stamp(path)
            if path in self.stamps:
                if now != self.stamps[path]:
                    return f"{path} is another file, or gone, or was changed"
            elif now is not None and now[4] >= self.taken_ns - CLOCK_SLACK_NS:
                return f"{path}, imported since this image began serving, was changed"
        return None


def _image_files() -> set[str]:
    """The interpreter, every imported module's file, every module file of our own."""
    files = {os.path.abspath(sys.executable)}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            files.add(os.path.abspath(path))
    for name in OWN_PACKAGES:
        package = sys.modules.get(name)
        for directory in getattr(package, "__path__", ()):
            for root, dirs, names in os.walk(directory):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                files.update(os.path.join(root, n) for n in names if n.endswith(".py"))
    return files


def _stamp(path: str) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
