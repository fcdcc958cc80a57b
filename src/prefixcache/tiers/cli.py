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
from prefixcache.tiers.record import domain_tag

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    purge = sub.add_parser("purge", help="remove one tenant's blocks from the disk and Valkey "
                           "tiers", description="remove one tenant's blocks from every tier")
    who = purge.add_mutually_exclusive_group(required=True)
    who.add_argument("--tenant", metavar="NAME", help="a tenant of the tenants file (or "
                     "'default' for a server without one)")
    who.add_argument("--domain", metavar="DOMAIN",
                     help="an isolation domain as the server names it: tenant:NAME, group:NAME")
    purge.add_argument("--kv-disk", metavar="DIR", help="the disk tier's directory")
    purge.add_argument("--kv-valkey", metavar="URL", help="the Valkey tier's server")


def run(args: argparse.Namespace) -> int:
    if args.kv_disk is None and args.kv_valkey is None:
        raise CliError("name a tier to purge: --kv-disk DIR and/or --kv-valkey URL")
    domain = args.domain if args.domain is not None else f"tenant:{args.tenant}"
    if not domain.startswith(("tenant:", "group:")) or domain.endswith(":"):
        raise CliError(f"not an isolation domain: {domain!r} (tenant:NAME or group:NAME)")
    tag = domain_tag(domain)
    removed: dict[str, int] = {}
    if args.kv_disk is not None:
        from pathlib import Path

        from prefixcache.tiers.disk import purge_dir

        if not Path(args.kv_disk).is_dir():
            raise CliError(f"--kv-disk {args.kv_disk!r} is not a directory")
        removed["disk"] = len(purge_dir(args.kv_disk, tag))
    if args.kv_valkey is not None:
        from prefixcache.tiers.valkey import connect, purge_client, redact_url

        try:
            removed["valkey"] = purge_client(connect(args.kv_valkey), tag)
        except ImportError as exc:
            raise CliError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - any client failure: say so, exit non-zero
            raise CliError(f"cannot purge Valkey at {redact_url(args.kv_valkey)}: "
                           f"{type(exc).__name__}: {exc}") from None
    print(json.dumps({"domain": domain, "removed": removed}))
    return 0
