"""``prefixcache serve``: one process (`prefixcache.server.cli`), or, with ``--replicas N`` above
1 or ``--ray-address``, N engine replicas on Ray Serve (`prefixcache.cluster.launch`). The flags
are the server's plus the cluster's; nothing heavy is imported before ``run``."""

from __future__ import annotations

import argparse

from prefixcache.cluster.launch import add_cluster_arguments
from prefixcache.server import cli as server_cli

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server_cli.add_arguments(parser)
    add_cluster_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.replicas > 1 or args.ray_address:
        from prefixcache.cluster.launch import run as run_cluster

        return run_cluster(args)
    return server_cli.run(args)
