"""Commands that talk to a server fail in one named line when it cannot be used (real servers
on loopback: none listening, one that refuses the credentials, one with an untrusted TLS
certificate), with an exit code that says whether trying again can help."""

import http.server
import os
import shutil
import ssl
import subprocess
import sys

import pytest
from helpers.loopback import serve_in_thread
from helpers.paths import REPO

from kfvision.pipelines.cli import main
from kfvision.pipelines.clients.endpoints import free_port
from kfvision.trainer.exitcodes import EXIT_AUTH, EXIT_TLS, EXIT_UNAVAILABLE


class _Refuses(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "unauthorized"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path):
    """start(tls) -> endpoint of a loopback server that answers 401 to everything."""
    servers = []

    def start(tls: bool) -> str:
        srv = http.server.HTTPServer(("127.0.0.1", 0), _Refuses)
        if tls:
            key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                            "1", "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", cert],
                           check=True, capture_output=True)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        serve_in_thread(srv)
        servers.append(srv)
        return f"{'https' if tls else 'http'}://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()


def _submit(endpoint: str, *extra) -> list:
    return ["pipeline", "submit", "--endpoint", endpoint, "--train-source",
            "https://example.com/digits.tar.gz", *extra]


def _one_named_line(err: str, name: str, endpoint: str) -> None:
    assert err.startswith(f"error: {name}: ") and endpoint in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_pipeline_submit_to_an_endpoint_nobody_listens_on(capsys):
    endpoint = f"http://127.0.0.1:{free_port()}"
    assert main(_submit(endpoint)) == EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    _one_named_line(err, "EndpointUnreachableError", endpoint)
    assert "port-forward" in err


def test_pipeline_submit_without_the_token_a_multi_user_kubeflow_needs(server, capsys):
    endpoint = server(tls=False)
    assert main(_submit(endpoint, "--token", "expired")) == EXIT_AUTH
    err = capsys.readouterr().err
    _one_named_line(err, "EndpointAuthError", endpoint)
    assert "HTTP 401" in err and "--token" in err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_pipeline_submit_to_an_untrusted_certificate(server, capsys):
    endpoint = server(tls=True)
    assert main(_submit(endpoint)) == EXIT_TLS
    err = capsys.readouterr().err
    _one_named_line(err, "EndpointTLSError", endpoint)
    assert "--ssl-ca-cert" in err


@pytest.mark.process  # a `kfvision job` process: 0.5-0.7 s of CPU (the kubernetes client)
@pytest.mark.parametrize("command", [["delete", "digits"], ["logs", "digits"]])
def test_job_commands_name_the_api_server_they_cannot_reach(command, tmp_path):
    endpoint = f"https://127.0.0.1:{free_port()}"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{endpoint}", insecure-skip-tls-verify: true}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u, namespace: team-a}}}}]
current-context: x
""")
    # a new process: the kubernetes client reads KUBECONFIG when it is imported
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    run = subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", "job", *command],
                         cwd=REPO,
                         env={**env, "KUBECONFIG": str(kubeconfig)}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == EXIT_UNAVAILABLE, run.stderr
    err = run.stderr
    _one_named_line(err, "EndpointUnreachableError", endpoint)
    assert "kubeconfig context" in err


def _kubeconfig(path, server: str) -> str:
    """A kubeconfig whose one context points at `server`: what a stale port-forward leaves."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{server}"}}}}]
users: [{{name: u, user: {{token: not-a-real-token}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u, namespace: team}}}}]
current-context: x
""")
    return str(path)


def test_job_deploy_and_tune_fail_alike_when_the_api_server_is_unreachable(
        tmp_path, monkeypatch, capsys):
    """One Kubernetes layer (pipelines/clients/k8s.py): the same failure gives the same named line
and
    exit code whichever command met it. Nothing listens on the port of the kubeconfig."""
    endpoint = f"https://127.0.0.1:{free_port()}"
    monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path / "kubeconfig", endpoint))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    common = ["--name", "digits", "--image", "registry.example.com/kfvision:1"]
    train = ["--model", "/d/m", "--train", "/d/t", "--val", "/d/v", "--out", "/d/o"]
    renders = {
        "job": ["job", "render", *common, *train],
        "tune": ["tune", "render", *common, *train, "--param", "lr=double:0.001:0.1"],
        "deploy": ["deploy", "render", *common, "--model", "pvc://data/models/digits"],
    }
    lines = {}
    for command, argv in renders.items():
        manifest = tmp_path / f"{command}.yaml"
        assert main([*argv, "-o", str(manifest)]) == 0
        capsys.readouterr()
        assert main([command, "submit", str(manifest)]) == EXIT_UNAVAILABLE, command
        err = capsys.readouterr().err
        _one_named_line(err, "EndpointUnreachableError", endpoint)
        lines[command] = err.split(" (", 1)[0]  # what follows names the object's call
    assert len(set(lines.values())) == 1, lines
    assert lines["job"] == ("error: EndpointUnreachableError: cannot reach the Kubernetes API "
                            f"at {endpoint}")
