"""torchrun's tee (`--tee`), every line: what kfvision's launcher (trainer/launch.py) puts in its
place while torchrun runs.

torchrun copies each training process's stdout and stderr files into its own output, a thread per
file (torch.distributed.elastic.multiprocessing.tail_log, `tail_logfile`). That thread reads a
line; at the end of the file it asks whether the process has ended, and stops if so. A line the
process wrote after the thread found the end and before the process was found ended is never
copied: its last lines, often its traceback, go missing from the pod's log whenever the thread is
kept off the CPU for the monitor's 0.1 s at that moment (a loaded node). Here the thread asks
first and reads after, so it stops only at an end of the file found after the process had ended:
everything the process wrote is copied. Same arguments, same output otherwise.

Written by hand because torch's loop is the whole function: no argument or hook orders the two.
torch 2.14.1 (constraints.txt): `tail_logfile(header, file, dst, finished, interval_sec,
log_line_filter)` in torch/distributed/elastic/multiprocessing/tail_log.py, which `TailLog.start`
looks up by that module's global name when it starts each thread (so replacing the name there
is enough); tests/trainer/test_taillog.py checks that torch's still loses the line.
"""

import contextlib
import os
import time


def tail_logfile(header: str, file: str, dst, finished, interval_sec: float,
                 log_line_filter=None) -> None:
    """Copy `file`'s lines to `dst`, each after `header`, until `finished` is set and the file
    is read to its end after that (torch's signature)."""
    while not os.path.exists(file):
        if finished.is_set() and not os.path.exists(file):
            return
        time.sleep(interval_sec)
    with open(file, errors="replace") as fp:
        while True:
            ended = finished.is_set()  # before the read: all it wrote is in the file by now
            line = fp.readline()
            if line:
                if log_line_filter is None or log_line_filter(line):
                    dst.write(f"{header}{line}")
            elif ended:
                break
            else:
                time.sleep(interval_sec)


@contextlib.contextmanager
def every_line():
    """Within the block, torchrun's tee threads run `tail_logfile` above; where torch lacks the
    name, nothing changes."""
    try:
        from torch.distributed.elastic.multiprocessing import tail_log
    except ImportError:
        yield
        return
    theirs = getattr(tail_log, "tail_logfile", None)
    if theirs is None:
        yield
        return
    tail_log.tail_logfile = tail_logfile
    try:
        yield
    finally:
        tail_log.tail_logfile = theirs
