"""A node's fetcher: the images of an `s3://` image directory that this node's ranks read, into the
node's scratch disk, in the order their samplers will ask for them (trainer/data/arrival.py is the
trainer's side: a rank waits for a file that is not there yet).

    fetcher = NodeFetcher(train, val, plan, arrival)  # two Channels, a Plan, the arrival folder
    fetcher.start()        # a thread; on a failure: fetcher.error set, arrival/failed written
    ...
    fetcher.stop(); fetcher.summary()   # objects and bytes per epoch and per channel

What is fetched, and when (the orders and the plan: pipelines/clients/fetchplan.py):
- epoch e's training images of this node's ranks, in their sampler's order (the same
  order, keyed the same: `rank_order`), interleaved rank by rank as the ranks read in step;
  the validation images of its ranks (every world_size-th, as EvalShard reads) after epoch 1's;
- an image already held is never fetched again: every epoch after the first only adds what the
  reshuffle brings that this node has not seen, until it holds the whole dataset;
- the next epoch's images only once a rank of this node has begun that epoch (`begin_epoch`),
  except the first `ahead` of them (read-ahead across the epoch's end, 2% of an epoch's share by
  default), so epoch 1 fetches at most 1.02 x the node's share;
- a file a rank has been waiting for (a `want-*` note) first, whatever the plan says: the order
  above is a prediction, and nothing breaks where it is wrong (a one-process node reading with
  persistent workers, a resumed run), training only waits.

Requests in flight: `max_connections` (the job's `--max-connections`) downloads at once, each a
thread waiting, without the interpreter's lock, on obstore's GET over a kept-alive connection of
its pool, and as many queued behind them; a 503 SlowDown
pauses every request of the process for its backoff (pipelines/clients/s3.py's `retried`). A
small GET (up to HEDGE_BYTES) that has run HEDGE_FACTOR times longer than the median of the last
ones (and at least `hedge_after` seconds) is asked again once beside it: whichever copy lands
first is kept (a stalled connection or a slow server thread does not hold a rank up), the other
one's bytes are counted apart (`hedged` in the summary).

Each object is downloaded by pipelines/clients/s3download.py's `download` (its GET obstore's,
pipelines/clients/s3obstore.py, where obstore checks what botocore would): the listed ETag asked for
(If-Match), size, ETag and MD5 checked, retried under the retry policy, written to a hidden part
file renamed into place when whole, so a file that exists is complete and a restarted pod never
reads half an object; the trainer then checks each image's sha256 against the manifest as it reads
it. A full scratch disk is a ScratchFullError that says how much room the node needs.
"""

import contextlib
import json
import math
import os
import statistics
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kfvision.pipelines.clients import s3, s3download, s3sync
from kfvision.pipelines.clients.fetchplan import (
    Channel,
    Plan,
    ScratchFullError,
    eval_share,
    node_order,
    rank_order,
    scratch_full,
)
from kfvision.trainer.data.arrival import ALIVE, FAILED, read_epochs
from kfvision.trainer.errors import OutputError
from kfvision.trainer.exitcodes import error_line

AHEAD_SHARE = 0.02  # of an epoch's share: fetched before the ranks begin that epoch
POLL_S = 0.02
NOTE, NOTE_BYTES = ".failed-note", 4096  # the failure note's room, taken before the disk fills
HEDGE_BYTES = 8 << 20  # a GET this small is asked again when it takes far longer than its peers
HEDGE_FACTOR = 8.0  # "far longer": this many times the median of the last GETs
HEDGE_AFTER_S = 1.0  # and never sooner than this


class NodeFetcher:
    """See the module doc. `val` may be None."""

    def __init__(self, train: Channel, val: Channel | None, plan: Plan, arrival: Path, *,
                 max_connections: int = s3.DEFAULT_CONNECTIONS, ahead: float = AHEAD_SHARE,
                 hedge_after: float = HEDGE_AFTER_S):
        self.train, self.val, self.plan = train, val, plan
        self.hedge_after = hedge_after
        self._running: dict = {}  # (channel, path) -> (Channel, time.monotonic() at its start)
        self._hedged: set = set()
        self._took: deque = deque(maxlen=256)  # seconds of the last small GETs
        self.second_copies = 0  # bytes of the hedged GETs' copies that landed second
        self._pool = None
        self.arrival = Path(arrival)
        self.max_connections = max_connections
        self.ahead = ahead
        self.held: set = set()  # (channel name, path) in place
        self._queued: set = set()
        self.fetched: dict = {}  # (the ranks' epoch when fetched, channel) -> [objects, bytes]
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = None
        self._epoch_read = (-1.0, 0)
        self._wants_read = -1.0
        self._touched = -1.0
        self.started = time.monotonic()

    # --- the plan
    def epoch_items(self, epoch: int) -> list:
        n = len(self.train.paths)
        orders = [rank_order(n, self.plan.world_size, r, self.plan.seed, epoch)
                  for r in self.plan.ranks]
        return [(self.train, i) for i in node_order(orders)]

    def val_items(self) -> list:
        if self.val is None:
            return []
        return [(self.val, i) for i in eval_share(len(self.val.paths), self.plan.world_size,
                                                   self.plan.ranks)]

    def trainer_epoch(self) -> int:
        """The epoch every rank of this node has begun (0: not all have begun one); read from
        the arrival folder at most every POLL_S."""
        now = time.monotonic()
        if now - self._epoch_read[0] >= POLL_S:
            epochs = read_epochs(self.arrival)
            self._epoch_read = (now, min((epochs.get(r, 0) for r in self.plan.ranks), default=0))
        return self._epoch_read[1]

    # --- running
    def start(self) -> "NodeFetcher":
        self.arrival.mkdir(parents=True, exist_ok=True)
        for note in (*self.arrival.glob("epoch-*"), *self.arrival.glob("want-*"),
                     self.arrival / FAILED):  # a previous run's, or a restarted container's
            with contextlib.suppress(FileNotFoundError):
                note.unlink()
        for ch in filter(None, (self.train, self.val)):
            s3sync.remove_stale_parts(ch.folder)
            for p in ch.paths:
                if (ch.folder / p).exists():  # a container restarted in the same pod
                    self.held.add((ch.name, p))
        (self.arrival / NOTE).write_bytes(b" " * NOTE_BYTES)  # see _tell_readers
        self._thread = threading.Thread(target=self._run, name="node-fetch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        pool = self._pool = ThreadPoolExecutor(self.max_connections + 4,  # + hedges
                                               thread_name_prefix="fetch")
        slots = threading.Semaphore(2 * self.max_connections)
        try:
            self._schedule(pool, slots)
            pool.shutdown(wait=True)
            if self.error is not None:
                raise self.error
        except BaseException as e:  # noqa: BLE001 (told to the readers, raised by the agent)
            self.error = self.error or e
            self._stop.set()
            self._tell_readers(error_line(self.error))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            self.done.set()

    def _tell_readers(self, line: str) -> None:
        """arrival/failed with `line`, written into the note reserved at start: a full disk (the
        usual reason to stop) has no room for a new file's first block."""
        note = self.arrival / NOTE
        with contextlib.suppress(OSError):
            with open(note, "r+b") as f:
                f.write(line.encode()[:NOTE_BYTES].ljust(NOTE_BYTES))
            os.replace(note, self.arrival / FAILED)

    def _schedule(self, pool, slots) -> None:
        epoch, val_sent = 1, False
        while epoch <= self.plan.epochs and not self._stop.is_set():
            items = self.epoch_items(epoch)
            ahead = math.ceil(self.ahead * len(items))
            for pos, item in enumerate(items):
                while not self._stop.is_set():
                    self._serve_wants(pool, slots)
                    begun = max(1, self.trainer_epoch())
                    if begun > epoch:  # the ranks are past this epoch (a resumed run)
                        break
                    if begun == epoch or pos < ahead:
                        self._submit(pool, slots, item)
                        break
                    self._idle()
                else:
                    return
                if max(1, self.trainer_epoch()) > epoch:
                    break
            if not val_sent:
                for item in self.val_items():
                    self._submit(pool, slots, item)
                val_sent = True
            epoch = max(epoch + 1, self.trainer_epoch())
        while not self._stop.is_set() and self.plan.epochs > 0:  # wants until told to stop
            self._serve_wants(pool, slots)
            self._idle()

    def _idle(self) -> None:
        self._touch()
        time.sleep(POLL_S)
        self._hedge(self._pool)

    def _hedge(self, pool) -> None:
        """Ask again, once, for each small GET that has run far longer than its peers."""
        if pool is None or len(self._took) < 8:
            return
        limit = max(self.hedge_after, HEDGE_FACTOR * statistics.median(self._took))
        now = time.monotonic()
        with self._lock:
            late = [(key, ch) for key, (ch, t) in self._running.items()
                    if now - t > limit and key not in self._hedged and key not in self.held
                    and ch.objects[key[1]].size <= HEDGE_BYTES]
            self._hedged.update(key for key, _ in late)
        for (_, rel), ch in late:
            pool.submit(self._fetch, ch, rel)

    def _touch(self) -> None:
        with contextlib.suppress(OSError):
            (self.arrival / ALIVE).touch()

    def _serve_wants(self, pool, slots) -> None:
        now = time.monotonic()
        if now - self._wants_read < POLL_S:
            return
        self._wants_read = now
        for note in self.arrival.glob("want-*"):
            try:
                path = Path(note.read_text())
            except OSError:
                continue
            for ch in filter(None, (self.train, self.val)):
                with contextlib.suppress(ValueError):
                    rel = path.relative_to(ch.folder).as_posix()
                    if rel in ch.objects:
                        self._submit(pool, slots, (ch, ch.index[rel]))

    def _submit(self, pool, slots, item) -> None:
        ch, i = item
        key = (ch.name, ch.paths[i])
        with self._lock:
            if key in self.held or key in self._queued:
                return
            self._queued.add(key)
        if self.error is not None:
            raise self.error
        while not slots.acquire(timeout=POLL_S):  # all in flight: look for a late one
            self._hedge(pool)
            if self.error is not None:
                raise self.error
        now = time.monotonic()
        if now - self._touched >= POLL_S:  # a sign of life for the readers, not a write per item
            self._touched = now
            self._touch()
        pool.submit(self._fetch, ch, ch.paths[i]).add_done_callback(lambda _: slots.release())

    def _fetch(self, ch: Channel, rel: str) -> None:
        if self._stop.is_set():
            return
        obj, key = ch.objects[rel], (ch.name, rel)
        bucket, _ = s3.split_uri(ch.uri)
        start = time.monotonic()
        with self._lock:
            self._running.setdefault(key, (ch, start))
        try:
            got = s3download.download(obj, bucket, ch.folder / rel, self.max_connections)
        except OutputError as e:
            self._fail(self.full(e))
            return
        except BaseException as e:  # noqa: BLE001 (the first failure stops the fetch)
            if key not in self.held:  # the other copy of a hedged GET may have landed
                self._fail(e)
            return
        epoch = max(1, self.trainer_epoch())
        with self._lock:
            self._running.pop(key, None)
            if obj.size <= HEDGE_BYTES:
                self._took.append(time.monotonic() - start)
            if key in self.held:  # the second copy of a hedged GET
                self.second_copies += got
                return
            self.held.add((ch.name, rel))
            row = self.fetched.setdefault((epoch, ch.name), [0, 0])
            row[0] += 1
            row[1] += got

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = e
        self._stop.set()

    def full(self, e: OutputError) -> ScratchFullError:
        need = sum(sum(ch.sizes) for ch in filter(None, (self.train, self.val)))
        return scratch_full(self.train.folder.parent, need, e)

    # --- what it did
    def summary(self) -> dict:
        """What the node fetched: `fetched` {epoch: {channel: [objects, bytes]}}, the epoch
        being the one the node's ranks were in (1 before they began), against `share` (epoch
        1's training images of this node's ranks, and its validation images) and `dataset`;
        `epoch`, the one its ranks are in now (0 before they began)."""
        share = {i for _, i in self.epoch_items(1)}
        val = {i for _, i in self.val_items()}
        chans = {"train": self.train, "val": self.val}
        now = self.trainer_epoch()
        with self._lock:
            fetched: dict = {}
            for (epoch, name), row in sorted(self.fetched.items()):
                fetched.setdefault(str(epoch), {})[name] = list(row)
            return {
                "ranks": list(self.plan.ranks), "world_size": self.plan.world_size,
                "dataset": {k: [len(c.sizes), sum(c.sizes)] for k, c in chans.items() if c},
                "share": {"train": [len(share), sum(self.train.sizes[i] for i in share)],
                          "val": [len(val), sum(self.val.sizes[i] for i in val) if self.val
                                  else 0]},
                "fetched": fetched,
                "epoch": now,
                "held": len(self.held),
                "hedged": {"gets": len(self._hedged), "second_copy_bytes": self.second_copies},
                "seconds": round(time.monotonic() - self.started, 3),
                "error": None if self.error is None else error_line(self.error)}


def write_summary(fetcher: NodeFetcher, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(fetcher.summary(), indent=1))
    os.replace(tmp, path)
