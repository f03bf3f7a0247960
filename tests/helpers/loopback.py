"""A test's HTTP server on a loopback port, served from a thread.

`socketserver`'s `serve_forever` looks for `shutdown()` every `poll_interval`, 0.5 s by default:
each test that stopped a server of its own waited up to that long, 20 such stops 9 s in one
test file. Here it looks every POLL_S."""

import threading

POLL_S = 0.02


def serve_in_thread(server, name: str | None = None) -> threading.Thread:
    """Start `server.serve_forever` in a daemon thread that `server.shutdown()` stops within
    POLL_S; the thread."""
    thread = threading.Thread(target=server.serve_forever, args=(POLL_S,), name=name,
                              daemon=True)
    thread.start()
    return thread
