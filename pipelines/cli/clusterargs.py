"""What the commands that talk to a cluster share: their flags, declared once in
pipelines/clients/cluster.py's ClusterOptions, and the one body of every `submit`.

A command that names an object on the cluster takes -n/--namespace; one that submits a manifest
takes --wait, --timeout and --poll too, and --keep-on-timeout where its kind's client deletes on
a timeout (a job). Adding one is a line:

    add_command(verbs, "status", _status, "a job's state and its pods'", name="job name")
    add_submit(verbs, JobClient, _submit, "create the job on the cluster", manifest="job YAML")
"""

import argparse
import sys

from kfvision.pipelines.clients.cluster import CLUSTER_OPTIONS, ClusterOptions, submit_and_wait
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.options import HelpFormatter, add_flags

TARGET = ("namespace",)  # every command that reads or changes an object on the cluster
WAITING = ("wait", "timeout", "poll")  # and those that submit one, which may wait for it


def add_cluster_flags(parser, names) -> None:
    """The flags of ClusterOptions named in `names`, as declared there."""
    add_flags(parser, [o for o in CLUSTER_OPTIONS if o.name in names])


def waiting_flags(client_class) -> tuple:
    """The names of the flags of a command that submits to `client_class`'s kind and waits."""
    return (*WAITING, *(("keep_on_timeout",) if client_class.deletes_on_timeout else ()))


def add_command(verbs, verb: str, func, help: str, *, name: str | None = None,
                flags=TARGET, **kwargs) -> argparse.ArgumentParser:
    """`kfvision GROUP VERB [NAME]` with the cluster flags `flags` (names of ClusterOptions'
    fields); `name`: the help of its NAME argument (None: it takes none). Returns the parser,
    for flags of its own."""
    p = verbs.add_parser(verb, help=help, formatter_class=HelpFormatter, **kwargs)
    if name is not None:
        p.add_argument("name", help=name)
    add_cluster_flags(p, flags)
    p.set_defaults(func=func)
    return p


def add_submit(verbs, client_class, func, help: str, *, manifest: str,
               **kwargs) -> argparse.ArgumentParser:
    """`kfvision GROUP submit MANIFEST` (`manifest`: its help) with every cluster flag its kind
    takes (`client_class`: a ClusterClient subclass)."""
    p = add_command(verbs, "submit", func, help, flags=(*TARGET, *waiting_flags(client_class)),
                    **kwargs)
    p.add_argument("manifest", help=manifest)
    return p


def namespace_of(args, manifest: dict | None = None) -> str | None:
    """-n, else the manifest's metadata.namespace (else None: the context's). Both, differing,
    are refused, as `kubectl apply -n` refuses them."""
    given = ((manifest or {}).get("metadata") or {}).get("namespace")
    if args.namespace and given and args.namespace != given:
        raise InvalidParameterError(f"--namespace {args.namespace} differs from the manifest's "
                                    f"metadata.namespace {given}; drop one of them.")
    return args.namespace or given


def submit_command(args, connect, manifest: dict, config_maps=(), **wait_kw) -> int:
    """The body of every `kfvision GROUP submit`: connect (`connect(namespace)` -> a
    ClusterClient) in the namespace of -n or the manifest, then submit_and_wait with the parsed
    flags (`wait_kw`: the kind's own, e.g. a job's `logs`). Ctrl-C stops waiting and leaves the
    object (exit 130)."""
    opts = ClusterOptions(**{o.name: getattr(args, o.name, o.default)
                             for o in CLUSTER_OPTIONS}).validate()
    client = connect(namespace_of(args, manifest))
    name = manifest["metadata"]["name"]
    try:
        submit_and_wait(client, manifest, config_maps=config_maps, wait=opts.wait,
                        timeout_s=opts.timeout, poll_s=opts.poll,
                        keep_on_timeout=opts.keep_on_timeout, **wait_kw)
    except KeyboardInterrupt:
        print(f"stopped waiting; {client.where(name)} goes on (submit it again to wait again; "
              f"kfvision {client.command} delete {name} -n {client.namespace} removes it)",
              file=sys.stderr)
        return 130
    return 0
