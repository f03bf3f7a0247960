"""torchrun's tee with kfvision's launcher (trainer/taillog.py): every line a training process
wrote reaches the pod's output, whenever the copying thread finds that the process has ended."""

import io
import threading

import pytest

from kfvision.trainer import taillog


class EndsAfterItsLastLine(threading.Event):
    """The moment the tee loses a line: the process writes its last line, and ends, just after
    the copying thread has read to the end of its file. The first time the thread asks whether
    the process has ended after the file's first line, that line is written and the answer is
    yes."""

    def __init__(self, path):
        super().__init__()
        self.path, self.asked = path, 0

    def is_set(self):
        self.asked += 1
        if self.asked == 2 and not super().is_set():
            with open(self.path, "a") as f:
                f.write("Traceback: the last line\n")
            self.set()
        return super().is_set()


def _copy(tail_logfile, folder) -> str:
    """What `tail_logfile` copies of a rank's file that holds one line when the copy starts and
    gets its last as the rank ends (EndsAfterItsLastLine)."""
    log = folder / "stderr.log"
    log.write_text("first line\n")
    out = io.StringIO()
    tail_logfile("[0/1] ", str(log), out, EndsAfterItsLastLine(log), 0.01, lambda _: True)
    return out.getvalue()


def test_the_last_line_written_as_the_process_ends_is_copied(tmp_path):
    assert _copy(taillog.tail_logfile, tmp_path) == \
        "[0/1] first line\n[0/1] Traceback: the last line\n"


def test_torchs_own_copy_loses_that_line(tmp_path):
    """What the launcher replaces (if torch's loop is ever fixed, this fails: the replacement can
    then go)."""
    tail_log = pytest.importorskip("torch.distributed.elastic.multiprocessing.tail_log")
    assert _copy(tail_log.tail_logfile, tmp_path) == "[0/1] first line\n"


def test_the_launcher_puts_it_in_torchs_place_only_while_torchrun_runs():
    from torch.distributed.elastic.multiprocessing import tail_log

    theirs = tail_log.tail_logfile
    with taillog.every_line():
        assert tail_log.tail_logfile is taillog.tail_logfile
    assert tail_log.tail_logfile is theirs


def test_a_file_that_never_comes_ends_the_copy_once_the_process_ended(tmp_path):
    ended = threading.Event()
    ended.set()
    out = io.StringIO()
    taillog.tail_logfile("[0/0] ", str(tmp_path / "none.log"), out, ended, 0.01)
    assert out.getvalue() == ""
