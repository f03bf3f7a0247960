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
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


class Batcher:
    """Runs `forward` (uint8 [n, 3, S, S] -> float [n, classes]) on batches of queued requests.

    Args:
        forward: the model call; runs on one dedicated thread, one batch at a time.
        max_batch: images per forward pass at most (a request with more runs alone, in chunks).
        max_wait_s: how long an idle model waits for requests still decoding.
        decode_threads: threads that decode images (`decode`).
        streams: forward passes that may run at once (`forward` must be safe to call from that
            many threads).
    """

    def __init__(self, forward, *, max_batch: int, max_wait_s: float, decode_threads: int,
                 streams: int = 1):
        self.forward, self.max_batch, self.max_wait_s = forward, max_batch, max_wait_s
        self.streams = streams
        self._decode_pool = ThreadPoolExecutor(decode_threads, thread_name_prefix="decode")
        self._forward_pool = ThreadPoolExecutor(streams, thread_name_prefix="forward")
        self._running: set[asyncio.Task] = set()  # forward passes under way
        # images answered by the last pass plus those queued when it ended: the clients that are
        # sending, when clients wait for their answer before sending again
        self._expect = 0
        self._queue: list = []  # (images [n, 3, S, S], future)
        self._decoding = 0  # requests between `decode` and `submit`
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.batches = self.images = 0  # counters, for the figures

    async def decode(self, fn, items: list) -> list:
        """[fn(item) for item in items] on the decode threads, in parallel; the first error raised
        propagates (after all have finished)."""
        loop = asyncio.get_running_loop()
        self._decoding += 1
        try:
            futures = [loop.run_in_executor(self._decode_pool, fn, *item) for item in items]
            results = await asyncio.gather(*futures, return_exceptions=True)
        except BaseException:
            self._decoding -= 1
            self._notify()
            raise
        self._decoding -= 1  # the caller submits next, in this same step of the loop
        self._notify()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def submit(self, images: torch.Tensor) -> np.ndarray:
        """Probabilities for `images`, computed in some batch with other requests' images."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._changed = asyncio.Event()
            self._task = loop.create_task(self._run())
        future = loop.create_future()
        self._queue.append((images, future))
        self._notify()
        return await future

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
            task = asyncio.get_running_loop().create_task(self._forward(self._take()))
            self._running.add(task)

    async def _forward(self, taken: list) -> None:
        """One forward pass over the requests `taken`, on a forward thread; their futures get
        their rows, or the model's error."""
        batch = torch.cat([x for x, _ in taken]) if len(taken) > 1 else taken[0][0]
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

