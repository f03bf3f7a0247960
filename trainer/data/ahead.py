"""Batches made one or two ahead of the training step, by a thread, on a CUDA stream of its own.

torchvision's nvJPEG decode blocks the calling thread until its batch is decoded (it synchronises
its own stream at the end: torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp). Called from the
training loop, that wait and the batch's crop launches come between two steps, while the GPU runs
out of queued work. Made by a thread instead, they overlap with the training loop's launches of
the step before (the decode runs with the GIL released), and the augmentation kernels run on a
side stream beside the step's.

Order and random numbers are those of the wrapped iterable: one thread makes every batch, in
order.
"""

import contextlib
import queue
import threading

import torch

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def ahead(batches, device: torch.device, depth: int = 2):
    """Yield the (images, labels) of the iterable `batches`, made by a thread up to `depth`
    batches ahead; on CUDA on a side stream, each batch handed over with an event the consumer's
    stream waits on. The iterable is not touched by the calling thread. An error raised while
    making a batch is raised here, where that batch would have come; a consumer that stops early
    (break, an error in the step) stops the thread."""
    slots: queue.Queue = queue.Queue(depth)
    stop = threading.Event()
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None

    def put(item) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            if cuda and device.index is not None:
                # a new thread starts on GPU 0: this rank's GPU for the decoder (which decodes
                # on the current device) and the DataLoader's pin-memory thread started here
                torch.cuda.set_device(device)
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for images, labels in batches:
                    ready = None
                    if cuda:
                        ready = torch.cuda.Event()
                        ready.record(stream)
                    if not put((images, labels, ready)):
                        return
        except BaseException as e:  # handed to the consumer, which raises it
            put(_Failed(e))
            return
        put(_DONE)

    thread = threading.Thread(target=produce, name="batches-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            images, labels, ready = item
            if ready is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(ready)
                images.record_stream(current)  # made on the side stream, freed after use here
            yield images, labels
    finally:
        stop.set()
        thread.join(timeout=10)

