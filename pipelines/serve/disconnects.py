"""REST requests whose client went away are cancelled, as gRPC's are.

uvicorn runs a request to its end even when its client has disconnected: the answer is then
thrown away, after its forward pass. `CancelOnDisconnect` reads a POST's body, then watches the
connection while the request runs, and cancels the request when the client leaves; a request
still queued for the model then leaves the queue (`Batcher.submit`). gRPC's server cancels the
handler of an RPC its client cancelled or dropped by itself.
"""

import asyncio


class CancelOnDisconnect:
    """ASGI middleware: cancel a POST whose client disconnects before its answer is complete."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        body = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its body arrived: nothing to answer
            body.append(message)
            if not message.get("more_body"):
                break
        gone = asyncio.Event()
        answered = False

        async def replay():
            if body:
                return body.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def sending(message):
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body"):
                answered = True
            await send(message)

        request = asyncio.ensure_future(self.app(scope, replay, sending))
        # after the body, uvicorn's receive() returns only when the client disconnects or the
        # response is complete
        watch = asyncio.ensure_future(receive())
        try:
            await asyncio.wait({request, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not request.done() and not answered:
                gone.set()
                request.cancel()
                await asyncio.wait({request})  # it ends cancelled: nothing to answer, no log
                return
            await request
        finally:
            for task in (request, watch):
                task.cancel()
