"""A FAKE Kubeflow Model Registry (its server needs MySQL or PostgreSQL and ships only as images:
it cannot run here), answering the REST API of the real OpenAPI spec."""

import json

from helpers.loopback import serve_in_thread

SPEC_PREFIX, CLIENT_PREFIX = "/api/model_registry/v1alpha3", "/api/model_registry/v1"


# Its server cannot run here (container images only, MySQL or PostgreSQL), so the `model-registry`
# client is tested against a FAKE of the endpoints it calls, written from the REST API spec in
# ../shared/reference/model-registry/ (kubeflow/hub, v1alpha3): every request must match a path
# and method of the spec, bodies are stored and echoed with the server's fields (id, times). The
# released client 0.3.18 calls the paths under /api/model_registry/v1 where the spec has v1alpha3;
# the fake serves the client's prefix and says so here (docs/tracking.md).

class FakeModelRegistry:
    def __init__(self, spec: dict):
        import http.server
        import itertools
        import re
        import urllib.parse

        self.objects, self.calls, ids = {}, [], itertools.count(1)
        routes = []
        for path, ops in spec["paths"].items():
            pattern = re.escape(path.replace(SPEC_PREFIX, CLIENT_PREFIX, 1))
            pattern = re.sub(r"\\\{[^}]+\\\}", "([^/]+)", pattern)
            routes += [(m.upper(), re.compile(pattern + "$"), path) for m in ops
                       if m in ("get", "post", "patch")]
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method):
                url = urllib.parse.urlsplit(self.path)
                for m, rx, spec_path in routes:
                    hit = rx.match(url.path)
                    if m == method and hit:
                        return spec_path, hit.groups(), dict(urllib.parse.parse_qsl(url.query))
                return None, (), {}

            def do_GET(self):
                spec_path, args, query = self._route("GET")
                fake.calls.append(("GET", spec_path))
                kind = {"/registered_model": "RegisteredModel", "/model_version": "ModelVersion",
                        "/model_artifact": "ModelArtifact",
                        "/registered_models": "list"}.get((spec_path or "")[len(SPEC_PREFIX):])
                if kind == "list":
                    items = [o for o in fake.objects.values() if o["_kind"] == "RegisteredModel"]
                    return self._answer(200, {"items": items, "size": len(items),
                                              "pageSize": int(query.get("pageSize", 100)),
                                              "nextPageToken": ""})
                parent = "modelVersionId" if kind == "ModelArtifact" else "registeredModelId"
                for o in fake.objects.values():
                    if (kind and o["_kind"] == kind and o["name"] == query.get("name") and
                            o.get(parent) == query.get("parentResourceId")):
                        return self._answer(200, o)
                self._answer(404, {"code": "404", "message": "not found"})

            def do_POST(self):
                spec_path, args, _ = self._route("POST")
                fake.calls.append(("POST", spec_path))
                if spec_path is None:
                    return self._answer(404, {"code": "404", "message": "no such path in spec"})
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                kind = {"/registered_models": "RegisteredModel", "/model_versions":
                        "ModelVersion"}.get(spec_path[len(SPEC_PREFIX):], "ModelArtifact")
                if kind == "ModelArtifact":
                    body["modelVersionId"] = args[0]
                obj = {**body, "_kind": kind, "id": str(next(ids)), "state": "LIVE",
                       "createTimeSinceEpoch": "1", "lastUpdateTimeSinceEpoch": "1",
                       "customProperties": body.get("customProperties", {})}
                fake.objects[obj["id"]] = obj
                self._answer(201, obj)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        serve_in_thread(self.server)

    def of(self, kind):
        return [o for o in self.objects.values() if o["_kind"] == kind]
