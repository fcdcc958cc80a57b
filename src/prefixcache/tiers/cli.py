"""``prefixcache cache``: the lower KV tiers from the command line (no engine, no torch).

    prefixcache cache purge --tenant acme --kv-disk /var/cache/prefixcache --kv-valkey redis://...

removes one tenant's blocks (its isolation domain, ``tenant:<name>``; ``--domain group:<name>``
for a trusted group) from the disk directory and the Valkey server, under every model identity.
A running server's RAM cache is purged through its admin endpoint (``POST /cache/purge``).
"""

from __future__ import annotations

import argparse
import json

from prefixcache.errors import CliError
from prefixcache.tiers import TIERS
from prefixcache.tiers.record import domain_tag

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    purge = sub.add_parser("purge", help="remove one tenant's blocks from the lower tiers",
                           description="remove one tenant's blocks from every tier named")
    who = purge.add_mutually_exclusive_group(required=True)
    who.add_argument("--tenant", metavar="NAME", help="a tenant of the tenants file (or "
                     "'default' for a server without one)")
    who.add_argument("--domain", metavar="DOMAIN",
                     help="an isolation domain as the server names it: tenant:NAME, group:NAME")
    for kind in TIERS.values():
        kind.add_arguments(purge, with_options=False)


def run(args: argparse.Namespace) -> int:
    named = {kind.name: (kind, location) for kind in TIERS.values()
             if (location := getattr(args, kind.dest, None)) is not None}  # fmt: skip
    if not named:
        flags = " and/or ".join(f"{k.flag} {k.metavar}" for k in TIERS.values())
        raise CliError(f"name a tier to purge: {flags}")
    domain = args.domain if args.domain is not None else f"tenant:{args.tenant}"
    if not domain.startswith(("tenant:", "group:")) or domain.endswith(":"):
        raise CliError(f"not an isolation domain: {domain!r} (tenant:NAME or group:NAME)")
    tag = domain_tag(domain)
    removed = {name: kind.purge(location, tag) for name, (kind, location) in named.items()}
    print(json.dumps({"domain": domain, "removed": removed}))
    return 0
