"""``prefixcache serve``: load a model, build the engine and app, run uvicorn.

The engine's flags build one `EngineConfig` (`add_engine_arguments`); the rest map onto
`create_app`; bad values become a one-line `CliError`.
Heavy imports (torch, fastapi, uvicorn) happen inside `run`.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from prefixcache.engine.config import add_engine_arguments
from prefixcache.errors import CliError
from prefixcache.server.protocol import JSONObject

if TYPE_CHECKING:
    from fastapi import FastAPI

    from prefixcache.engine.llm_engine import LLMEngine
    from prefixcache.engine.request import Request
    from prefixcache.model.tokenizer import Tokenizer
    from prefixcache.sched import DomainLimits
    from prefixcache.server.kv_events import KVEventsConfig
    from prefixcache.server.tenancy import TenantRegistry

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "add_arguments", "build_app", "run", "tenant_registry",
           "uvicorn_options"]

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024

logger = logging.getLogger("prefixcache.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    _add_listen_arguments(parser)
    _add_tenancy_arguments(parser)
    _add_request_arguments(parser)
    _add_metrics_arguments(parser)
    _add_connection_arguments(parser)
    _add_kv_events_arguments(parser)
    _add_lora_arguments(parser)
    parser.add_argument("--no-retain-freed-memory", action="store_true",
                        help="keep glibc's malloc defaults (by default the server keeps freed "
                             "tensor memory mapped, avoiding page-fault churn in prefills)")


def _add_listen_arguments(parser: argparse.ArgumentParser) -> None:
    """The served model's id, the address, logging and what runs before the port opens."""
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients send (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-interval", type=float, default=10.0, metavar="SECONDS")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    parser.add_argument("--warm", default=None, metavar="FILE",
                        help="JSONL of prompts or conversations to prefill (and pin, with a "
                             "ttl) per tenant before the port opens (docs/prompt-caching.md)")
    parser.add_argument("--record-trace", default=None, metavar="FILE",
                        help="append each finished request's token counts and block digests "
                             "(never text) to FILE, for `prefixcache simulate`")


def _add_tenancy_arguments(parser: argparse.ArgumentParser) -> None:
    """Who may call, their namespaces and each one's share of the engine."""
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="TOML file of API keys -> tenants (see examples/tenants.toml); "
                             "without it the server is single-tenant and trusts client salts")
    parser.add_argument("--secret-file", default=None,
                        help="server secret for salt derivation (else $PREFIXCACHE_SECRET, "
                             "else random per process)")
    parser.add_argument("--domain-max-seqs", type=int, default=None,
                        help="cap on one tenant's (or group's) running sequences; tenants-file "
                             "field max_running_seqs overrides it per tenant")
    parser.add_argument("--domain-max-kv-blocks", type=int, default=None,
                        help="cap on one tenant's (or group's) KV blocks; tenants-file field "
                             "max_kv_blocks overrides it per tenant")


def _add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """How requests are queued, bounded and read."""
    parser.add_argument("--max-queue-len", type=int, default=256,
                        help="waiting requests beyond --max-num-seqs before answering 429")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="chat max_tokens when the client sends none")
    parser.add_argument("--trust-special-tokens-in-content", action="store_true",
                        help="tokenize marker strings inside chat message content as control "
                             "tokens (default: as text, so no caller can forge a turn)")
    parser.add_argument("--strict-api", action="store_true",
                        help="reject request fields this server does not know (400) instead of "
                             "ignoring them with a warning naming them")


def _add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """/metrics and the dashboard."""
    parser.add_argument("--metrics-key", default=None,
                        help="with --tenants: a key that may read /metrics (admins' keys may too)")
    parser.add_argument("--metrics-domain-labels", default="name",
                        choices=("name", "digest", "off"),
                        help="the metrics' domain label: tenant/group name, a stable digest of "
                             "it, or one value for all")
    parser.add_argument("--no-dashboard", action="store_true",
                        help="do not serve GET /dashboard (the live view of the cache)")
    parser.add_argument("--no-vllm-metric-names", action="store_true",
                        help="leave vLLM's metric names (vllm:...) out of /metrics; by default "
                             "they are exported beside ours, so vLLM's dashboards work")


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """Limits on a connection, before a request reaches an endpoint."""
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="larger request bodies get 413 before they are read (default 8 MiB)")
    parser.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="close a connection whose request headers are not complete in time")
    parser.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                        help="close an idle keep-alive connection after this long")


def _add_kv_events_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="publish KV cache events as vLLM does, e.g. "
                             "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                             "\"endpoint\": \"tcp://127.0.0.1:5557\"}' (docs/kv-events.md)")
    parser.add_argument("--kv-events-token-ids", default="auto", choices=("auto", "on", "off"),
                        help="token ids in published BlockStored events (auto: off with "
                             "--tenants, where they are tenant data; on otherwise)")


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """The adapters served from the start, and runtime loading (the engine's LoRA flags,
    ``--enable-lora`` and the limits, are `add_engine_arguments`'; docs/lora.md)."""
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters to serve, as name=path or vLLM's JSON form "
                             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a "
                             "request picks one with model: NAME (needs --enable-lora)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter to "
                             "admin tenants (also: VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")


def _check_args(args: argparse.Namespace) -> None:
    positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "default_max_tokens")
    for name in positive:
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        raise CliError("--num-kv-blocks must be >= 1")
    if args.max_queue_len < 0:
        raise CliError("--max-queue-len must be >= 0")
    if not 0 < args.port < 65536:
        raise CliError(f"--port must be in 1..65535, got {args.port}")
    if args.log_interval <= 0:
        raise CliError("--log-interval must be > 0")
    for name in ("domain_max_seqs", "domain_max_kv_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_request_bytes < 1024:
        raise CliError("--max-request-bytes must be >= 1024")
    if args.header_timeout <= 0 or args.timeout_keep_alive <= 0:
        raise CliError("--header-timeout and --timeout-keep-alive must be > 0")


def tenant_registry(args: argparse.Namespace, secret: bytes | None = None) -> TenantRegistry:
    """The tenants registry; ``secret`` given (a cluster's replicas share one) or loaded."""
    from prefixcache.server.tenancy import TenancyError, TenantRegistry, load_secret, load_tenants

    try:
        by_key = load_tenants(args.tenants) if args.tenants else None
        secret, source = (secret, "the cluster") if secret else load_secret(args.secret_file)
    except TenancyError as exc:
        raise CliError(str(exc)) from None
    registry = TenantRegistry(by_key, secret)
    if registry.trusted:
        logger.warning("no --tenants file: single-tenant mode, every caller is trusted, client "
                       "cache_salt values are used as given and anyone may reset the cache")
    else:
        logger.info("tenants: %d API keys; server secret from %s", registry.num_keys, source)
        if source == "random":
            logger.info("the server secret is random: cache namespaces change on restart")
    return registry


def declare_public_prefixes(args: argparse.Namespace, tenants: TenantRegistry,
                            tokenizer: Tokenizer, vocab_size: int) -> None:  # fmt: skip
    """The tenants file's public prefixes, rendered by the model's ``tokenizer``, into
    ``tenants`` (a replica's, and a cluster ingress's: its router names blocks as they do)."""
    if not args.tenants:
        return
    from prefixcache.server.public_prefixes import load_public_access
    from prefixcache.server.tenancy import TenancyError

    try:
        tenants.public = load_public_access(
            args.tenants, tenants.tenants(), tokenizer, vocab_size,
            literal_content=not args.trust_special_tokens_in_content)
    except TenancyError as exc:
        raise CliError(str(exc)) from None
    prefixes = tenants.public.prefixes
    if len(prefixes):
        logger.info("public prefixes: %s", ", ".join(
            f"{name} ({len(prefixes.token_ids(name))} tokens)" for name in prefixes.names))


def _domain_limits(
    args: argparse.Namespace, tenants: TenantRegistry | None
) -> tuple[DomainLimits, dict[str, DomainLimits]]:
    """The default caps and each tenant's (a group takes the tightest of its members')."""
    from prefixcache.sched.fairness import DomainLimits

    default = DomainLimits(args.domain_max_seqs, args.domain_max_kv_blocks)
    limits: dict[str, DomainLimits] = {}
    for tenant in tenants.tenants() if tenants is not None else []:
        seqs = tenant.max_running_seqs or default.max_seqs
        blocks = tenant.max_kv_blocks or default.max_blocks
        known = limits.get(tenant.scheduling_domain)
        if known is not None:
            seqs = min(x for x in (seqs, known.max_seqs) if x) if seqs or known.max_seqs else None
            blocks = (min(x for x in (blocks, known.max_blocks) if x)
                      if blocks or known.max_blocks else None)
        limits[tenant.scheduling_domain] = DomainLimits(seqs, blocks)
    return default, limits


def _pin_budgets(tenants: TenantRegistry | None) -> dict[str, int]:
    """Each domain's pin budget from the tenants file (a group takes its members' smallest)."""
    budgets: dict[str, int] = {}
    for tenant in tenants.tenants() if tenants is not None else []:
        if tenant.max_pinned_blocks is not None:
            domain = tenant.scheduling_domain
            budgets[domain] = min(budgets.get(domain, tenant.max_pinned_blocks),
                                  tenant.max_pinned_blocks)
    return budgets


def _kv_events(
    args: argparse.Namespace, tenants: TenantRegistry | None
) -> tuple[KVEventsConfig | None, bool]:
    """The KV events config (None: nothing published) and whether events carry token ids."""
    if not getattr(args, "kv_events_config", None):
        return None, False
    from prefixcache.errors import require_extra

    require_extra("zmq", "events", "--kv-events-config")
    require_extra("msgspec", "events", "--kv-events-config")
    from prefixcache.server.kv_events import KVEventsConfig

    config = KVEventsConfig.from_json(args.kv_events_config)
    if not config.publishes:
        return None, False
    mode = args.kv_events_token_ids
    with_tokens = mode == "on" or (mode == "auto" and (tenants is None or tenants.trusted))
    return config, with_tokens


def _engine(args: argparse.Namespace, tenants: TenantRegistry | None = None,
            events: bool = False, event_tokens: bool = False) -> LLMEngine:
    from dataclasses import replace

    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.llm_engine import LLMEngine

    default_limits, limits = _domain_limits(args, tenants)
    try:
        config = EngineConfig.from_args(
            args, domain_limits=limits, default_domain_limits=default_limits,
            pin_budgets=_pin_budgets(tenants),
        )
        if events:
            config = replace(config, cache=replace(config.cache, enable_kv_events=True,
                                                   events_with_tokens=event_tokens))
        return LLMEngine(config=config)
    except (ValueError, OSError) as exc:
        raise CliError(f"cannot start the engine: {exc}") from None


def _record_trace(engine: LLMEngine, path: str, epoch: float | None = None) -> None:
    """Record every finished request (counts and prompt block digests) for the simulator;
    ``epoch``: times count from this wall-clock instant (a cluster's replicas share one)."""
    import time

    from prefixcache.sim.record import TraceRecorder, tenant_label

    clock = time.time if epoch is not None else time.monotonic
    try:
        recorder = TraceRecorder(path, engine.block_size, engine.engine_config.cache.hash_algo,
                                 clock=clock, start=epoch)
    except OSError as exc:
        raise CliError(f"cannot write --record-trace {path}: {exc.strerror}") from None
    def record(request: Request) -> None:
        digests = engine.prompt_block_digests(request)
        domain = request.domain
        recorder.record(request.num_prompt_tokens, len(request.output_token_ids), digests,
                        max(request.num_cached_tokens, 0), pins=request.pin_requests,
                        tenant=tenant_label(domain) if domain else "",
                        adapter=request.seq.adapter or "")

    engine.on_request_finished = record
    logger.info("recording finished requests (counts and block digests only) to %s", path)


def build_app(args: argparse.Namespace, secret: bytes | None = None) -> FastAPI:
    """The app for parsed ``serve`` arguments (tests use this without uvicorn's CLI); ``secret``
    overrides ``--secret-file`` (cluster replicas share the launcher's)."""
    from prefixcache.server.app import create_app

    _check_args(args)
    if not args.no_retain_freed_memory:
        from prefixcache.model.host_memory import retain_freed_memory

        retain_freed_memory()  # this process is a server: see prefixcache.model.host_memory
    tenants = tenant_registry(args, secret)
    events_config, event_tokens = _kv_events(args, tenants)
    engine = _engine(args, tenants, events_config is not None, event_tokens)
    declare_public_prefixes(args, tenants, engine.tokenizer, engine.model_config.vocab_size)
    from prefixcache.server.lora import runtime_updating, start_lora_modules

    start_lora_modules(engine, args)  # --lora-modules, before the port opens
    from prefixcache.tools.cachelog import configure_from_env

    configure_from_env(engine)  # PREFIXCACHE_LOG=json: JSON logs + cache decisions (no text)
    if getattr(args, "warm", None):
        from prefixcache.server.warm import warm_from_file

        warm_from_file(engine, tenants, args.warm,
                       literal_content=not args.trust_special_tokens_in_content)
    if args.record_trace:
        _record_trace(engine, args.record_trace, getattr(args, "trace_epoch", None))
    from prefixcache.attention import native_attention
    from prefixcache.model import native_layers

    cache = engine.engine_config.cache
    kind = cache.kind if cache.enable_prefix_caching else "off"
    logger.info("model %s: context %d tokens, %d KV blocks of %d tokens in %s, prefix cache %s, "
                "attention %s, element-wise layers %s",
                args.model, engine.max_model_len, engine.limits.num_kv_blocks, args.block_size,
                engine.limits.precision.get("kv_cache", {}).get("dtype", "?"),
                "off" if kind == "off" else f"{kind}/{args.hash_algo}",
                "compiled CPU kernel" if native_attention.available() else "torch",
                "compiled" if native_layers.available() else "torch")
    app = create_app(engine, model_name=args.served_model_name or args.model, tenants=tenants,
                     max_queue_len=args.max_queue_len,
                     default_max_tokens=args.default_max_tokens,
                     log_interval_s=args.log_interval,
                     max_request_bytes=args.max_request_bytes,
                     trust_content_markers=args.trust_special_tokens_in_content,
                     metrics_key=args.metrics_key,
                     metrics_domain_labels=args.metrics_domain_labels,
                     strict_api=args.strict_api,
                     vllm_metric_names=not args.no_vllm_metric_names,
                     dashboard=not args.no_dashboard,
                     lora_updating=runtime_updating(args) and engine.loras is not None)
    if events_config is not None:
        from prefixcache.server.kv_events import ZmqEventPublisher

        kv_cache = engine.limits.precision.get("kv_cache", {})
        publisher = ZmqEventPublisher(events_config, event_tokens, kv_cache.get("dtype"))
        app.state.kv_event_publisher = publisher
        app.state.async_engine.kv_event_sink = publisher.publish
        app.state.async_engine.on_stop.append(publisher.close)
    return app


def uvicorn_options(args: argparse.Namespace) -> JSONObject:
    """uvicorn settings for parsed ``serve`` arguments: timeouts, and logging left to us in
    JSON mode so uvicorn's records reach the JSON handler."""
    import uvicorn

    from prefixcache.server.limits import header_timeout_protocol
    from prefixcache.tools.cachelog import json_logging_enabled

    return {
        "access_log": False,
        "log_config": None if json_logging_enabled() else uvicorn.config.LOGGING_CONFIG,
        "timeout_keep_alive": args.timeout_keep_alive,
        "http": header_timeout_protocol(args.header_timeout),
    }


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    **uvicorn_options(args))
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    return 0
