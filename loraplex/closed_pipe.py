"""A command whose output's reader goes away (``loraplex usage export | head -1``) stops as a shell command stopped
by SIGPIPE does: exit code 141 (128 + SIGPIPE) and one line on stderr, not a BrokenPipeError traceback.

Python ignores SIGPIPE, so a write to a pipe nobody reads raises BrokenPipeError instead of ending the process.
The CLI entry point (loraplex/cli.py) catches it for every command; ``loraplex batch`` catches it itself, to say
how many lines were written. Leaf module: the engine's batch command imports it too.
"""

from __future__ import annotations

import os
import select
import signal
import sys

EXIT_CODE = 128 + signal.SIGPIPE


def reader_gone(stream=None) -> bool:
    """Whether ``stream`` (default stdout) is a pipe or socket whose reading end is closed: a BrokenPipeError
    from anything else (a worker process's pipe, a socket) is not this, and keeps its traceback."""
    try:
        fd = (stream if stream is not None else sys.stdout).fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor, or closed
        return False
    if not hasattr(select, "poll"):  # no poll (Windows): the common case
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def stop(message: str, stream=None) -> int:
    """Write ``message`` as one line on stderr and return the exit code of a command stopped by SIGPIPE.

    ``stream`` (default stdout) is pointed at /dev/null first: the rest of its buffer would otherwise fail again
    when Python flushes it at exit ("Exception ignored ... BrokenPipeError")."""
    fd = (stream if stream is not None else sys.stdout).fileno()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    return EXIT_CODE
