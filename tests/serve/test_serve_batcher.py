"""The serving batcher: concurrent requests share forward passes, a lone one does not wait."""

import asyncio
import time

import numpy as np
import pytest
import torch

from kfvision.pipelines.serve.batcher import Batcher, QueueFull


class Recorder:
    """A forward pass that records its batch sizes: image i's 'probabilities' are [its value]."""

    def __init__(self, delay: float = 0.0, fail_on: int | None = None):
        self.sizes, self.delay, self.fail_on = [], delay, fail_on

    def __call__(self, batch: torch.Tensor) -> np.ndarray:
        self.sizes.append(len(batch))
        time.sleep(self.delay)
        if self.fail_on is not None and int(batch[0, 0, 0, 0]) == self.fail_on:
            raise RuntimeError("the model failed")
        return batch[:, 0, 0, :1].float().numpy()


def _images(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 1, 1, 2)


def _decode(value: int) -> torch.Tensor:
    time.sleep(0.01)
    if value < 0:
        raise ValueError(f"image {value} is broken")
    return _images(value)[0]


async def _request(batcher: Batcher, values: list) -> list:
    decoded = await batcher.decode(_decode, [(v,) for v in values])
    probs = await batcher.submit(torch.stack(decoded))
    return probs[:, 0].astype(int).tolist()


def _run(batcher, *requests):
    async def go():
        try:
            return await asyncio.gather(*(_request(batcher, r) for r in requests),
                                        return_exceptions=True)
        finally:
            batcher.close()
    return asyncio.run(go())


def test_a_lone_request_does_not_wait_for_the_window():
    forward = Recorder()
    batcher = Batcher(forward, max_batch=8, max_wait_s=2.0, decode_threads=2)
    start = time.perf_counter()
    assert _run(batcher, [7]) == [[7]]
    assert time.perf_counter() - start < 1.0 and forward.sizes == [1]


def test_concurrent_requests_share_forward_passes_and_get_their_own_answers():
    forward = Recorder(delay=0.05)
    batcher = Batcher(forward, max_batch=8, max_wait_s=0.05, decode_threads=4)
    requests = [[i] for i in range(12)] + [[20, 21, 22]]
    assert _run(batcher, *requests) == requests
    assert sum(forward.sizes) == 15 and len(forward.sizes) < 13
    assert max(forward.sizes) <= 8 and batcher.batches == len(forward.sizes)


@pytest.mark.parametrize("values, max_batch, sizes", [
    (list(range(10)), 4, [4, 4, 2]),  # bigger than a batch: runs alone, in chunks
    (list(range(4)), 4, [4]),
    ([5], 4, [1]),
])
def test_a_request_bigger_than_a_batch_runs_in_chunks(values, max_batch, sizes):
    forward = Recorder()
    batcher = Batcher(forward, max_batch=max_batch, max_wait_s=0.0, decode_threads=2)
    assert _run(batcher, values) == [values]
    assert forward.sizes == sizes


def test_a_failed_forward_fails_its_requests_and_the_next_one_runs():
    forward = Recorder(fail_on=13)
    batcher = Batcher(forward, max_batch=8, max_wait_s=0.0, decode_threads=2)

    async def go():
        try:
            with pytest.raises(RuntimeError, match="the model failed"):
                await _request(batcher, [13])
            return await _request(batcher, [3])
        finally:
            batcher.close()
    assert asyncio.run(go()) == [3]


def test_a_decode_error_fails_only_its_request():
    batcher = Batcher(Recorder(), max_batch=8, max_wait_s=0.5, decode_threads=2)
    got = _run(batcher, [1, -1], [2])
    assert isinstance(got[0], ValueError) and "image -1 is broken" in str(got[0])
    assert got[1] == [2] and batcher._decoding == 0


class Overlap(Recorder):
    """A forward pass that records how many passes ran at once at most."""

    def __init__(self, delay: float):
        super().__init__(delay)
        self.running = self.most = 0
        self._lock = __import__("threading").Lock()

    def __call__(self, batch):
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return super().__call__(batch)
        finally:
            with self._lock:
                self.running -= 1


@pytest.mark.parametrize("streams", [1, 2, 3])
def test_streams_bound_the_forward_passes_that_run_at_once(streams):
    forward = Overlap(delay=0.1)
    batcher = Batcher(forward, max_batch=2, max_wait_s=0.0, decode_threads=8, streams=streams)
    requests = [[i] for i in range(12)]
    assert _run(batcher, *requests) == requests
    assert forward.most == streams and max(forward.sizes) <= 2
    assert sum(forward.sizes) == 12 and batcher.images == 12


def _closed_loop(batcher, clients: int, rounds: int, stagger: float = 0.0):
    """`clients` clients that each send one image, wait for the answer, and send again after
    10 ms (the network); client k starts after k // 2 * `stagger` seconds."""
    async def client(k):
        await asyncio.sleep(k // 2 * stagger)
        answers = []
        for _ in range(rounds):
            answers.append(await _request(batcher, [k]))
            await asyncio.sleep(0.01)
        return answers

    async def go():
        try:
            return await asyncio.gather(*(client(k) for k in range(clients)))
        finally:
            batcher.close()
    return asyncio.run(go())


def test_clients_that_wait_for_their_answers_are_batched_together_not_in_turns():
    """Four clients whose answers come back while the others' images are in the model: without
    waiting for the returning ones the passes alternate between halves of them."""
    forward = Recorder(delay=0.05)
    batcher = Batcher(forward, max_batch=8, max_wait_s=0.2, decode_threads=4)
    assert _closed_loop(batcher, 4, 6, stagger=0.03) == [[[k]] * 6 for k in range(4)]
    # the first pass has the first two clients; from then on all four share each pass (the
    # last two clients, having started later, finish alone): [2, 4, 4, 4, 4, 4, 2] here; in
    # turns it would be [2] * 12
    assert forward.sizes.count(4) >= 4 and len(forward.sizes) <= 8, forward.sizes


def test_a_lone_client_sending_again_and_again_never_waits_for_the_window():
    forward = Recorder()
    batcher = Batcher(forward, max_batch=8, max_wait_s=2.0, decode_threads=2)
    start = time.perf_counter()
    assert _closed_loop(batcher, 1, 5) == [[[0]] * 5]
    assert time.perf_counter() - start < 1.0 and forward.sizes == [1] * 5


# --- the bounded queue, and requests whose client went away ----------------------------------

@pytest.mark.parametrize("max_queue, refused", [(0, 0), (20, 0), (4, 8), (1, 11)])
def test_beyond_max_queue_requests_are_refused_at_once_and_the_others_answered(max_queue,
                                                                               refused):
    """12 one-image requests arriving together: at most `max_queue` wait; the rest are
    refused before any decoding, with a time to retry in."""
    forward = Recorder(delay=0.2)
    batcher = Batcher(forward, max_batch=16, max_wait_s=0.0, decode_threads=4,
                      max_queue=max_queue, rate=10.0)
    got = _run(batcher, *[[i] for i in range(12)])
    full = [g for g in got if isinstance(g, QueueFull)]
    assert len(full) == batcher.refused == refused
    assert all(g == [i] for i, g in enumerate(got) if not isinstance(g, QueueFull))
    assert all(1 <= f.retry_after <= 60 and "at capacity" in str(f) for f in full)
    assert sum(forward.sizes) == 12 - refused


def test_a_request_finding_the_queue_empty_is_taken_whatever_its_size():
    forward = Recorder()
    batcher = Batcher(forward, max_batch=4, max_wait_s=0.0, decode_threads=2, max_queue=2)
    assert _run(batcher, list(range(10))) == [list(range(10))]


def test_a_cancelled_request_still_queued_costs_no_forward_pass():
    """While a pass runs, three requests queue; one's caller is cancelled (its client left):
    it leaves the queue, the next pass carries only the other two."""
    forward = Recorder(delay=0.3)
    batcher = Batcher(forward, max_batch=8, max_wait_s=0.0, decode_threads=2)

    async def go():
        try:
            first = asyncio.create_task(_request(batcher, [1]))
            await asyncio.sleep(0.1)  # its pass is running
            queued = [asyncio.create_task(_request(batcher, [v])) for v in (2, 3, 4)]
            await asyncio.sleep(0.1)  # decoded and queued behind the pass
            queued[1].cancel()
            return await asyncio.gather(first, *queued, return_exceptions=True)
        finally:
            batcher.close()
    got = asyncio.run(go())
    assert got[0] == [1] and got[1] == [2] and got[3] == [4]
    assert isinstance(got[2], asyncio.CancelledError)
    assert forward.sizes == [1, 2] and batcher.images == 3 and batcher.dropped == 1
    assert batcher.waiting() == 0
