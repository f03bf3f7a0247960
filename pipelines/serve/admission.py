"""REST requests refused before their body is read when the queue is already full.

The model's own check (`Batcher.admit`, from `ImageClassifier.classify`) comes after KServe has
read and parsed the body: for a refused 100 KB request, most of its cost, paid on the event loop
that the accepted requests share. `RefuseWhenFull` answers an inference POST at once when even a
one-image request would be refused, and leaves the rest to the model's check.
"""


class RefuseWhenFull:
    """ASGI middleware: `refusal()` (None, or the exception to answer with) decides, before the
    body of an inference POST (`:predict`, `/infer`) is read; `respond(exc)` is the response."""

    def __init__(self, app, refusal, respond):
        self.app, self.refusal, self.respond = app, refusal, respond

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope.get("method") == "POST"
                and scope.get("path", "").endswith((":predict", "/infer"))):
            refused = self.refusal()
            if refused is not None:
                return await self.respond(refused)(scope, receive, send)
        return await self.app(scope, receive, send)
