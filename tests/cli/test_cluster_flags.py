"""The flags every command that talks to a cluster shares, against their one declaration
(ClusterOptions, pipelines/clients/cluster.py), and the verbs every cluster client implements
(ClusterClient there). The flags and their defaults come from the declaration; the table below
says only which commands talk to a cluster, and to which kind of object they submit."""

import argparse
import inspect

import pytest
import yaml
from helpers.fake_kserve import ISVC, NOT_READY, FakeKServe, client_for
from helpers.parsers import command_parser, every_parser, sub_commands
from kfvision.pipelines.cli import main
from kfvision.pipelines.cli.clusterargs import (
    TARGET,
    WAITING,
    add_command,
    submit_command,
    waiting_flags,
)
from kfvision.pipelines.clients.cluster import (
    CLUSTER_OPTIONS,
    POLL_S,
    ClusterClient,
    ClusterOptions,
    LogsClient,
)
from kfvision.pipelines.jobs.jobclient import JobClient
from kfvision.pipelines.serve.deployclient import DeployClient
from kfvision.pipelines.tune.experimentclient import ExperimentClient
from kfvision.trainer.options import ArgumentParser

# The commands that submit a manifest to a cluster: the client of the kind they submit.
SUBMIT = {("job", "submit"): JobClient, ("tune", "submit"): ExperimentClient,
          ("deploy", "submit"): DeployClient}
# The commands that name an object on a cluster (or a KFP endpoint's namespace), and the shared
# flags they take besides -n.
TARGETS = {("job", "logs"): ("poll",), ("job", "delete"): (), ("job", "download"): (),
           ("tune", "status"): (), ("tune", "delete"): (), ("deploy", "delete"): (),
           ("pipeline", "submit"): ("wait", "timeout", "poll"), ("job", "status"): ("poll",),
           ("job", "list"): ()}
OPTIONS = {o.name: o for o in CLUSTER_OPTIONS}


def _parser(words):
    parser = command_parser(words[0])
    for word in words:
        parser = sub_commands(parser)[word]
    return parser


def _cluster_actions(parser) -> dict:
    """{option name: action} of the parser's flags that are a ClusterOptions field."""
    return {a.dest: a for a in parser._actions if a.dest in OPTIONS and a.option_strings}


def _expected(words) -> set:
    if words in SUBMIT:
        return {*TARGET, *waiting_flags(SUBMIT[words])}
    return {*TARGET, *TARGETS[words]}


@pytest.mark.parametrize("words", [*SUBMIT, *TARGETS], ids=" ".join)
def test_every_cluster_command_has_the_shared_flags_as_declared(words):
    actions = _cluster_actions(_parser(words))
    assert set(actions) == _expected(words)
    for name, action in actions.items():
        opt = OPTIONS[name]
        assert set(action.option_strings) >= set(opt.flags), name  # -n and --namespace
        assert action.default == opt.default, name
        assert action.help.startswith(opt.help), name


def test_the_declaration_has_one_default_each_and_no_timeout_limit():
    assert ClusterOptions() == ClusterOptions(namespace=None, wait=False, timeout=None,
                                              poll=POLL_S, keep_on_timeout=False)
    assert OPTIONS["namespace"].flags == ("--namespace", "-n")


@pytest.mark.parametrize("words", list(SUBMIT), ids=" ".join)
def test_the_timeout_behaviour_flag_is_where_a_timeout_deletes(words):
    """A job is deleted on a timeout (its GPUs freed) unless --keep-on-timeout; an Experiment or
    an InferenceService is left as it is, so their commands have no such flag."""
    has = "keep_on_timeout" in _cluster_actions(_parser(words))
    assert has == SUBMIT[words].deletes_on_timeout == (words[0] == "job")


def test_job_run_submits_with_the_same_waiting_flags():
    """`job run --submit` (its namespace: job render's --namespace, the job's own)."""
    from kfvision.pipelines.cli.flags import run_args

    parser = _parser(("job", "run"))
    assert set(_cluster_actions(parser)) == {"namespace", *waiting_flags(JobClient)}
    args = parser.parse_args(["--name", "x", "--image", "i", "--source", ".", "--entry", "t.py",
                              "--submit", "--wait", "--timeout", "60", "--poll", "2"])
    then = run_args(args)
    assert (then.wait, then.timeout, then.poll, then.keep_on_timeout) == (True, 60, 2, False)


def test_no_parser_spells_a_shared_flag_with_another_default():
    """Flags written by hand drifted (--poll was 5, 10 or 30 s): wherever one of the shared
    spellings appears, it has the declared default."""
    spelled = {f: o for o in CLUSTER_OPTIONS for f in o.flags}
    for words, parser in every_parser():
        for action in parser._actions:
            for flag in set(action.option_strings) & set(spelled):
                opt = spelled[flag]
                assert (action.dest, action.default) == (opt.name, opt.default), (words, flag)


def test_adding_a_cluster_command_is_one_line():
    verbs = ArgumentParser(prog="kfvision job").add_subparsers(dest="verb")
    add_command(verbs, "status", lambda args: 0, "a job's state", name="job name")
    args = verbs._name_parser_map["status"].parse_args(["digits", "-n", "team"])
    assert (args.name, args.namespace) == ("digits", "team")
    assert set(_cluster_actions(verbs._name_parser_map["status"])) == set(TARGET)


@pytest.mark.parametrize("flag, value, says", [("--poll", "0", "0 < --poll"),
                                               ("--timeout", "-1", "0 < --timeout")])
def test_a_poll_or_timeout_out_of_range_is_refused_before_connecting(tmp_path, capsys, flag,
                                                                      value, says):
    manifest = tmp_path / "isvc.yaml"
    manifest.write_text(yaml.safe_dump(ISVC))
    assert main(["deploy", "submit", str(manifest), "--wait", flag, value]) == 2
    assert says in capsys.readouterr().err


def test_ctrl_c_stops_waiting_and_leaves_it(capsys):
    fake = FakeKServe([NOT_READY])
    client = client_for(fake)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    client.wait = interrupted
    args = argparse.Namespace(namespace=None, wait=True, timeout=None, poll=POLL_S)
    assert submit_command(args, lambda namespace: client, ISVC) == 130
    err = capsys.readouterr().err
    assert "stopped waiting; InferenceService kubeflow/digits goes on" in err
    assert "kfvision deploy delete digits -n kubeflow removes it" in err
    assert "digits" in fake.objects


VERBS = sorted(ClusterClient.__abstractmethods__)
CLIENTS = [JobClient, DeployClient, ExperimentClient]


def test_the_protocol_names_the_verbs_of_kubeflow_sdks_backends():
    assert VERBS == ["delete", "submit", "wait"]
    assert sorted(LogsClient.__abstractmethods__) == ["delete", "logs", "submit", "wait"]


@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.__name__)
def test_every_cluster_client_implements_the_protocols_verbs(client):
    assert issubclass(client, ClusterClient) and not client.__abstractmethods__
    for verb in VERBS:
        assert getattr(client, verb) is not getattr(ClusterClient, verb), verb
    wait = inspect.signature(client.wait).parameters
    assert list(wait)[:4] == ["self", "name", "timeout_s", "poll_s"]
    assert (wait["timeout_s"].default, wait["poll_s"].default) == (None, POLL_S)
    assert client.command in {n for n, _ in SUBMIT} and client.what


def test_logs_are_a_verb_of_the_kind_whose_pods_run_our_code():
    assert [c for c in CLIENTS if issubclass(c, LogsClient)] == [JobClient]


def test_the_cli_adds_every_declared_flag_somewhere():
    assert {*TARGET, *WAITING, *waiting_flags(JobClient)} == set(OPTIONS)
