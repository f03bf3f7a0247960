"""Batching concurrent requests into one forward pass, on an asyncio event loop.

Requests decode their images on a thread pool (`decode`); the decoded images queue here; up to
`streams` forward passes run at once, each on its own thread. While they all run, the requests
that arrive queue up and become the next batch. When a stream is free, a batch starts at once
unless other requests are still decoding, or fewer images are queued than the last pass
answered plus those that waited for it (the clients that are sending, when each waits for its
answer before sending again): then it waits for them, up to `max_wait_s` and `max_batch` images.
A lone client therefore never waits for a window; concurrent clients share forward passes
instead of taking turns in halves, and on a machine with several cores several passes can run
side by side.

The queue is bounded: `decode` refuses a request at once (`QueueFull`) when its images would take
the images waiting (being decoded or queued, not those in a running pass) past `max_queue`, unless
none are waiting. A request whose caller is cancelled (its client went away) while it is queued
leaves the queue before any pass: it costs no forward pass.
"""

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


class QueueFull(Exception):
    """A request refused because the queue is full; retry in `retry_after` seconds."""

    def __init__(self, waiting: int, max_queue: int, retry_after: int):
        super().__init__(f"the server is at capacity: {waiting} images are waiting for the model "
                         f"(at most {max_queue}); retry in {retry_after} s")
        self.retry_after = retry_after


class Batcher:
    """Runs `forward` (uint8 [n, 3, S, S] -> float [n, classes]) on batches of queued requests.

    Args:
        forward: the model call; runs on one dedicated thread, one batch at a time.
        max_batch: images per forward pass at most (a request with more runs alone, in chunks).
        max_wait_s: how long an idle model waits for requests still decoding.
        decode_threads: threads that decode images (`decode`).
        streams: forward passes that may run at once (`forward` must be safe to call from that
            many threads).
        max_queue: images waiting (being decoded or queued) at most; 0: no bound.
        rate: images per second the model is expected to answer (a measured pass), the
            first estimate of how long the queue takes to drain; passes update it.
    """

    def __init__(self, forward, *, max_batch: int, max_wait_s: float, decode_threads: int,
                 streams: int = 1, max_queue: int = 0, rate: float = 0.0):
        self.forward, self.max_batch, self.max_wait_s = forward, max_batch, max_wait_s
        self.streams, self.max_queue, self.rate = streams, max_queue, rate
        self._decode_pool = ThreadPoolExecutor(decode_threads, thread_name_prefix="decode")
        self._forward_pool = ThreadPoolExecutor(streams, thread_name_prefix="forward")
        self._running: set[asyncio.Task] = set()  # forward passes under way
        # images answered by the last pass plus those queued when it ended: the clients that are
        # sending, when clients wait for their answer before sending again
        self._expect = 0
        self._queue: list = []  # (images [n, 3, S, S], future)
        self._decoding = 0  # requests between `decode` and `submit`
        self._decoding_images = 0  # their images
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.batches = self.images = 0  # counters, for the figures
        self.refused = self.dropped = 0  # requests refused (queue full), left before a pass

    async def decode(self, fn, items: list) -> list:
        """[fn(item) for item in items] on the decode threads, in parallel; the first error raised
        propagates (after all have finished). Raises QueueFull, before any work, when the queue
        has no room for len(items) images."""
        self.admit(len(items))
        loop = asyncio.get_running_loop()
        self._decoding += 1
        self._decoding_images += len(items)
        try:
            futures = [loop.run_in_executor(self._decode_pool, fn, *item) for item in items]
            results = await asyncio.gather(*futures, return_exceptions=True)
        finally:
            # on success the caller submits next, in this same step of the loop
            self._decoding -= 1
            self._decoding_images -= len(items)
            self._notify()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def waiting(self) -> int:
        """Images being decoded or queued (not those in a running pass)."""
        return self._decoding_images + self._queued()

    def admit(self, n: int) -> None:
        """Raise QueueFull when `n` more images would take the queue past `max_queue` (a request
        finding no image waiting is always taken: a bigger one runs alone, in chunks)."""
        waiting = self.waiting()
        if self.max_queue and waiting and waiting + n > self.max_queue:
            self.refused += 1
            raise QueueFull(waiting, self.max_queue, self.retry_after())

    def retry_after(self) -> int:
        """Whole seconds until the images waiting and running are likely answered (1 to 60)."""
        ahead = self.waiting() + self.max_batch * len(self._running)
        return 1 if self.rate <= 0 else min(60, max(1, math.ceil(ahead / self.rate)))

    async def submit(self, images: torch.Tensor) -> np.ndarray:
        """Probabilities for `images`, computed in some batch with other requests' images. If the
        caller is cancelled while they are still queued, they leave the queue: no pass for them."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._changed = asyncio.Event()
            self._task = loop.create_task(self._run())
        future = loop.create_future()
        entry = (images, future)
        self._queue.append(entry)
        self._notify()
        try:
            return await future
        except asyncio.CancelledError:
            if any(e is entry for e in self._queue):
                self._queue[:] = [e for e in self._queue if e is not entry]
                self.dropped += 1
                self._notify()
            raise

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _queued(self) -> int:
        return sum(len(x) for x, _ in self._queue)

    async def _gather(self) -> None:
        """Wait (up to max_wait_s) while others are decoding, or fewer images are queued than
        the last batch's clients (`_expect`), and the batch is not full."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        want = min(self.max_batch, max(1, self._expect))
        while (self._decoding or self._queued() < want) and self._queued() < self.max_batch:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:  # not the builtin before Python 3.11
                return

    def _take(self) -> list:
        """Whole requests up to max_batch images; at least one (a bigger one runs in chunks)."""
        taken = [self._queue.pop(0)]
        n = len(taken[0][0])
        while self._queue and n + len(self._queue[0][0]) <= self.max_batch:
            taken.append(self._queue.pop(0))
            n += len(taken[-1][0])
        return taken

    def _forward_chunked(self, batch: torch.Tensor) -> np.ndarray:
        if len(batch) <= self.max_batch:
            return self.forward(batch)
        return np.concatenate([self.forward(batch[i:i + self.max_batch])
                               for i in range(0, len(batch), self.max_batch)])

    async def _run(self) -> None:
        while True:
            if not self._queue or len(self._running) >= self.streams:
                self._changed.clear()
                await self._changed.wait()
                continue
            await self._gather()
            if not self._queue:  # their clients went away while it gathered
                continue
            task = asyncio.get_running_loop().create_task(self._forward(self._take()))
            self._running.add(task)

    async def _forward(self, taken: list) -> None:
        """One forward pass over the requests `taken`, on a forward thread; their futures get
        their rows, or the model's error."""
        batch = torch.cat([x for x, _ in taken]) if len(taken) > 1 else taken[0][0]
        start = time.perf_counter()
        try:
            probs = await asyncio.get_running_loop().run_in_executor(
                self._forward_pool, self._forward_chunked, batch)
        except Exception as e:  # the model failed: those requests fail, the server goes on
            for _, future in taken:
                if not future.done():
                    future.set_exception(e)
            return
        finally:
            self._running.discard(asyncio.current_task())
            self._notify()  # a stream is free
        self.batches += 1
        self.images += len(batch)
        # images per second of all streams, smoothed: how fast the queue drains
        rate = len(batch) * self.streams / max(time.perf_counter() - start, 1e-6)
        self.rate = rate if self.rate <= 0 else 0.8 * self.rate + 0.2 * rate
        self._expect = len(batch) + self._queued()
        start = 0
        for x, future in taken:
            if not future.done():
                future.set_result(probs[start:start + len(x)])
            start += len(x)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._running):
            task.cancel()
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
        self._forward_pool.shutdown(wait=False, cancel_futures=True)

