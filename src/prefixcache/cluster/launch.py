"""``prefixcache serve --replicas N``: start (or join) Ray, deploy the cluster, wait.

Without ``--ray-address`` (and without ``$RAY_ADDRESS``) a local Ray instance is started for
this process and ends with it; with one, the application is deployed into that cluster and
deleted again on exit. Serve's HTTP proxy listens on ``--host``/``--port``. Every replica loads
the model itself; all of them and the ingress share one server secret (the file's, the
environment's, or a random one made here), so a tenant's cache namespace is the same on every
replica and the ingress can name a prompt's blocks as their caches do.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import threading
import time
from pathlib import Path

from prefixcache.errors import CliError

__all__ = ["add_cluster_arguments", "check_cluster_args", "run"]

logger = logging.getLogger("prefixcache.cluster")

APP_NAME = "prefixcache"
ROUTERS = ("round-robin", "prefix-affinity", "cache-aware", "cache-aware-tier-blind",
           "ray-prefix-aware")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster (Ray Serve; needs prefixcache[cluster])")
    group.add_argument("--replicas", type=int, default=1,
                       help="engine replicas; more than 1 (or --ray-address) serves through "
                            "Ray Serve with a prefix-aware router")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (e.g. 'auto' or 'HOST:6379'; default: "
                            "$RAY_ADDRESS, else a local Ray instance for this process)")
    group.add_argument("--router", default="cache-aware", choices=ROUTERS,
                       help="how requests pick a replica (the simulator's routers; "
                            "ray-prefix-aware: Ray Serve LLM's PrefixCacheAffinityRouter over "
                            "block digests)")
    group.add_argument("--affinity-blocks", type=int, default=4, metavar="K",
                       help="prefix-affinity: hash the chain's first K block digests")
    group.add_argument("--cpus-per-replica", type=float, default=None,
                       help="Ray CPUs each replica reserves (default: the machine's cores "
                            "split evenly, at least 1)")
    group.add_argument("--threads-per-replica", type=int, default=None,
                       help="torch threads per replica (default: its CPUs, at least 1)")


def check_cluster_args(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise CliError("--replicas must be >= 1")
    if args.affinity_blocks < 1:
        raise CliError("--affinity-blocks must be >= 1")
    if args.cpus_per_replica is None:
        args.cpus_per_replica = float(max(1, (os.cpu_count() or 1) // args.replicas))
    if args.cpus_per_replica <= 0:
        raise CliError("--cpus-per-replica must be > 0")
    if args.threads_per_replica is None:
        args.threads_per_replica = max(1, int(args.cpus_per_replica))
    if args.threads_per_replica < 1:
        raise CliError("--threads-per-replica must be >= 1")


def _secret(args: argparse.Namespace) -> bytes:
    from prefixcache.server.tenancy import TenancyError, load_secret

    try:
        secret, source = load_secret(args.secret_file)
    except TenancyError as exc:
        raise CliError(str(exc)) from None
    if source == "random":  # one for the whole cluster, not one per replica
        secret = secrets.token_bytes(32)
    return secret


def _connect(args: argparse.Namespace) -> bool:
    """Join or start Ray; True when this process started it."""
    import ray

    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address, log_to_driver=True)
            return False
        # "local": a Ray of our own even where `ray start` left a cluster to find (ray.init
        # would join that one, and refuse the CPU count)
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1,
                                               int(args.replicas * args.cpus_per_replica + 0.999)),
                 include_dashboard=False)
        return True
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if not address:
            raise CliError(f"cannot start Ray: {exc}") from None
        raise CliError(f"cannot join Ray at {address}: {exc} (a cluster with token "
                       "authentication needs its token here: ~/.ray/auth_token, "
                       "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)") from None


def run(args: argparse.Namespace) -> int:
    from prefixcache.errors import require_extra

    require_extra("ray", "cluster", "--replicas")
    require_extra("zmq", "cluster", "--replicas")
    check_cluster_args(args)
    from ray import serve

    from prefixcache.cluster.deployments import build

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    secret = _secret(args)
    if args.record_trace:  # replicas may run elsewhere than this directory
        args.record_trace = str(Path(args.record_trace).resolve())
        args.trace_epoch = time.time()
    started = _connect(args)
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        if stop.is_set():  # a second signal: leave now
            os._exit(130)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build(args, secret), name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("serving %s on http://%s:%d through Ray Serve: %d replicas, router %s, "
                    "%.3g CPUs and %d threads each", args.model, args.host, args.port,
                    args.replicas, args.router, args.cpus_per_replica, args.threads_per_replica)
        while not stop.wait(0.5):
            pass
    finally:
        _shut_down(started, args.record_trace)
    return 0


def _shut_down(started: bool, record_trace: str | None, timeout_s: float = 60.0) -> None:
    """Delete the application (stop Serve and Ray if this process started them) and merge the
    recorded trace; bounded in time, so a wedged Ray cannot keep the command from exiting."""
    import ray
    from ray import serve

    def work() -> None:
        try:
            serve.delete(APP_NAME)
            if started:
                serve.shutdown()  # type: ignore[no-untyped-call]
        except Exception as exc:  # Ray already gone: nothing left to delete
            logger.warning("cluster shutdown: %s", exc)
        if record_trace:
            _merge_trace(record_trace)
        ray.shutdown()

    logger.info("shutting the cluster application down")
    worker = threading.Thread(target=work, name="prefixcache-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning("cluster shutdown did not finish in %.0f s; exiting anyway", timeout_s)


def _merge_trace(path: str) -> None:
    from prefixcache.sim.record import merge_records

    target = Path(path)
    parts = sorted(target.parent.glob(target.name + ".*.part"))
    if not parts:
        logger.warning("--record-trace: no replica wrote a trace part next to %s", path)
        return
    n = merge_records(parts, target)
    for part in parts:
        part.unlink()
    logger.info("recorded %d requests from %d replicas to %s", n, len(parts), path)
