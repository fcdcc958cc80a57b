"""Declared public prefixes through a real server and the official openai SDK: permitted tenants
share the declared blocks (and nothing after them), the usage block and /metrics show the public
part apart, a tenant not listed or of isolation ``none`` gets none, a bad declaration stops the
start with a clear error, and a public block on disk is found by another tenant after a restart
while a private one is not."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import openai
import pytest

from prefixcache.cluster.digests import PromptDigester
from prefixcache.errors import CliError
from prefixcache.server.cli import (
    add_arguments,
    build_app,
    declare_public_prefixes,
    tenant_registry,
)
from prefixcache.server.public_prefixes import read_public_prefixes
from prefixcache.server.tenancy import TenancyError, load_tenants
from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
BS = 16
KEYS = {
    "a": "sk-tenant-a-0001",
    "b": "sk-tenant-b-0002",
    "c": "sk-tenant-c-0003",
    "n": "sk-tenant-n-0004",
    "ops": "sk-tenant-ops-005",
}
SECRET = b"0123456789abcdef0123456789abcdef"
# 100 characters: with the tiny model's byte tokenizer, BOS + 100 tokens = 6 whole blocks (96
# public tokens) and 5 tokens of a partial block, which stay each tenant's own
MANUAL = (
    "The operator's published manual: every tenant reads the same text, so its blocks are public."
)[:100].ljust(100, ".")
SUPPORT = "You are the support assistant of Example Corp. Answer briefly and politely, please."
SECRET_TAIL = " tenant a's secret continuation: account 4711, balance 1,000,000."
OTHER_TAIL = " a guess at what some other tenant might have sent after the manual"

TENANTS = f"""
[tenants.a]
api_keys = ["{KEYS["a"]}"]
[tenants.b]
api_keys = ["{KEYS["b"]}"]
[tenants.c]
api_keys = ["{KEYS["c"]}"]
[tenants.n]
api_keys = ["{KEYS["n"]}"]
isolation = "none"
[tenants.ops]
api_keys = ["{KEYS["ops"]}"]
admin = true

[public_prefixes.manual]
prompt = "{MANUAL}"
tenants = ["a", "b"]

[public_prefixes.support]
system_file = "support.txt"
tenants = ["a", "b"]
"""


def write_tenants(directory: Path, text: str = TENANTS) -> Path:
    (directory / "support.txt").write_text(SUPPORT)
    path = directory / "tenants.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module", params=["hash", "radix"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> RunningServer:
    """One server per prefix cache: both honour the split."""
    directory = tmp_path_factory.mktemp("public")
    (directory / "secret").write_bytes(SECRET)
    running = start_server(
        [
            "--model",
            MODEL,
            "--tenants",
            str(write_tenants(directory)),
            "--secret-file",
            str(directory / "secret"),
            "--block-size",
            str(BS),
            "--num-kv-blocks",
            "256",
            "--prefix-cache",
            request.param,
        ]
    )
    yield running
    running.stop()


def details(server: RunningServer, tenant: str, prompt: str) -> dict[str, int]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEYS[tenant], max_retries=0)
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return dict(out.usage.prompt_tokens_details.model_dump(exclude_none=True))


def test_the_declared_prefix_is_shared_and_its_continuation_is_not(
    server: RunningServer,
) -> None:
    first = details(server, "a", MANUAL + SECRET_TAIL)
    assert (first["cached_tokens"], first["public_cached_tokens"]) == (0, 0)
    # b probes a's exact prompt and another continuation: the same answer, the public part only
    probe_same = details(server, "b", MANUAL + SECRET_TAIL)
    probe_other = details(server, "b", MANUAL + OTHER_TAIL)
    assert probe_same["cached_tokens"] == probe_same["public_cached_tokens"] == 96
    assert probe_other == {**probe_same, "cache_write_tokens": probe_other["cache_write_tokens"]}
    # a's own continuation is a's: the whole prompt but its last block, 96 of them public
    again = details(server, "a", MANUAL + SECRET_TAIL)
    num_prompt = 1 + len(MANUAL + SECRET_TAIL)
    assert again["cached_tokens"] == (num_prompt - 1) // BS * BS
    assert again["public_cached_tokens"] == 96


def test_a_tenant_not_listed_or_without_a_cache_gets_nothing(server: RunningServer) -> None:
    details(server, "a", MANUAL + " warm")
    for tenant in ("c", "n"):
        seen = details(server, tenant, MANUAL + " warm")
        assert seen["cached_tokens"] == 0 and "public_cached_tokens" not in seen


def test_a_prompt_that_diverges_inside_the_prefix_keeps_the_blocks_before(
    server: RunningServer,
) -> None:
    details(server, "a", MANUAL)
    changed = MANUAL[:50] + "X" + MANUAL[51:]  # token 51 (BOS first): 3 whole blocks before it
    seen = details(server, "b", changed)
    assert seen["cached_tokens"] == seen["public_cached_tokens"] == 48


def test_a_system_message_declared_as_text_is_shared_in_chat(server: RunningServer) -> None:
    def chat(tenant: str, question: str) -> dict[str, int]:
        client = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=KEYS[tenant], max_retries=0
        )
        out = client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            temperature=0.0,
            messages=[
                {"role": "system", "content": SUPPORT},
                {"role": "user", "content": question},
            ],
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return dict(out.usage.prompt_tokens_details.model_dump(exclude_none=True))

    system_ids = server.engine.tokenizer.encode_chat(
        [{"role": "system", "content": SUPPORT}], add_generation_prompt=False
    )
    chat("a", "Where is my parcel number 99?")
    seen = chat("b", "How do I reset my password?")
    assert seen["cached_tokens"] == seen["public_cached_tokens"] == len(system_ids) // BS * BS > 0


def test_the_responses_api_counts_the_public_part(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEYS["b"], max_retries=0)
    messages = [{"role": "system", "content": SUPPORT},
                {"role": "user", "content": "Which languages do you speak?"}]  # fmt: skip
    for _ in range(2):  # the second one hits the first one's blocks
        out = client.responses.create(model=MODEL, input=messages, max_output_tokens=1)
    assert out.usage is not None
    usage = out.usage.input_tokens_details.model_dump()
    assert 0 < usage["public_cached_tokens"] < usage["cached_tokens"]  # b's own question too


def test_diagnostics_show_the_public_part(server: RunningServer) -> None:
    def chat(question: str, earlier: str | None = None) -> dict[str, object]:
        body: dict[str, object] = {
            "model": MODEL, "max_tokens": 1, "temperature": 0.0,
            "messages": [{"role": "system", "content": SUPPORT},
                         {"role": "user", "content": question}]}  # fmt: skip
        if earlier is not None:
            body["prompt_cache_options"] = {"comparison_response_id": earlier}
        response = httpx.post(
            server.base_url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {KEYS['b']}"},
            timeout=60,
        )
        assert response.status_code == 200
        return dict(response.json())

    first = chat("What are your opening hours on public holidays?")
    second = chat("What are your opening hours on public holidays?", str(first["id"]))
    public = second["usage"]["prompt_tokens_details"]["public_cached_tokens"]  # type: ignore[index]
    assert public > 0
    assert second["prompt_cache_diagnostics"] == {
        "type": "cache_hit",
        "public_tokens": public,
        "public_cached_tokens": public,
    }


def test_metrics_count_public_hits_apart(server: RunningServer) -> None:
    details(server, "a", MANUAL + " metrics")
    details(server, "b", MANUAL + " metrics")
    text = httpx.get(
        server.base_url + "/metrics", headers={"authorization": f"Bearer {KEYS['ops']}"}
    ).text
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("prefixcache:prefix_cache_domain_hits_total")
    }
    assert samples['prefixcache:prefix_cache_domain_hits_total{domain="public"}'] >= 96


# ---- the declarations -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ('prompt = "x"\ntenants = ["zed"]', "no tenant 'zed'"),
        ('prompt = "x"\ntenants = ["n"]', "isolation 'none'"),
        ('prompt = "x"\ntoken_ids = [1]\ntenants = ["a"]', "exactly one of"),
        ('token_ids = [1, -2]\ntenants = ["a"]', "token_ids"),
        ('prompt = "x"\ntenants = []', "non-empty list"),
        ('prompt_file = "missing.txt"\ntenants = ["a"]', "cannot read"),
        ('prompt = "x"\ncolour = "red"\ntenants = ["a"]', "unknown field"),
    ],
)
def test_bad_declarations_are_refused(tmp_path: Path, table: str, fragment: str) -> None:
    base = TENANTS.split("[public_prefixes.manual]")[0]
    path = write_tenants(tmp_path, base + "[public_prefixes.p]\n" + table + "\n")
    with pytest.raises(TenancyError) as info:
        read_public_prefixes(path, set(load_tenants(path).values()))
    assert fragment in str(info.value) and "[public_prefixes.p]" in str(info.value)


def test_star_names_every_tenant_that_caches(tmp_path: Path) -> None:
    base = TENANTS.split("[public_prefixes.manual]")[0]
    path = write_tenants(
        tmp_path, base + '[public_prefixes.p]\ntoken_ids = [1, 2]\ntenants = ["*"]\n'
    )
    (spec,) = read_public_prefixes(path, set(load_tenants(path).values()))
    assert sorted(spec.tenants) == ["a", "b", "c", "ops"]  # not n: isolation none


def test_a_token_id_outside_the_vocabulary_stops_the_start(tmp_path: Path) -> None:
    base = TENANTS.split("[public_prefixes.manual]")[0]
    path = write_tenants(
        tmp_path, base + '[public_prefixes.p]\ntoken_ids = [99999]\ntenants = ["a"]\n'
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(CliError, match="vocabulary"):
        build_app(
            parser.parse_args(["--model", MODEL, "--tenants", str(path), "--dtype", "float32"])
        )


# ---- tiers: the split survives a restart ------------------------------------------------------


def test_a_public_block_on_disk_serves_another_tenant_after_a_restart(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(SECRET)
    argv = [
        "--model",
        MODEL,
        "--tenants",
        str(write_tenants(tmp_path)),
        "--secret-file",
        str(tmp_path / "secret"),
        "--block-size",
        str(BS),
        "--kv-disk",
        str(tmp_path / "kv"),
    ]
    first = start_server(argv)
    try:
        details(first, "a", MANUAL + SECRET_TAIL)
        assert first.engine.flush_tiers(30)
    finally:
        first.stop()
    second = start_server(argv)  # RAM is empty: only the disk remembers
    try:
        probe = details(second, "b", MANUAL + SECRET_TAIL)
        assert probe["cached_tokens"] == probe["external_cached_tokens"] == 96
        assert probe["public_cached_tokens"] == 96
        own = details(second, "a", MANUAL + SECRET_TAIL)
        assert own["cached_tokens"] == (len(MANUAL + SECRET_TAIL)) // BS * BS  # a's own blocks
    finally:
        second.stop()


def test_a_tenants_purge_leaves_the_public_blocks_to_the_others(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(SECRET)
    running = start_server(["--model", MODEL, "--tenants", str(write_tenants(tmp_path)),
                            "--secret-file", str(tmp_path / "secret"), "--block-size", str(BS),
                            "--kv-disk", str(tmp_path / "kv")])  # fmt: skip
    try:
        details(running, "a", MANUAL + SECRET_TAIL)
        assert running.engine.flush_tiers(30)
        purged = httpx.post(
            running.base_url + "/cache/purge",
            json={"tenant": "a"},
            headers={"authorization": f"Bearer {KEYS['ops']}"},
            timeout=30,
        )
        assert purged.status_code == 200
        removed = purged.json()["removed"]
        assert removed["ram"] == removed["disk"] == 4  # a's own 4 blocks; the 6 public stay
        again = details(running, "a", MANUAL + SECRET_TAIL)
        assert again["cached_tokens"] == again["public_cached_tokens"] == 96
        probe = details(running, "b", MANUAL + OTHER_TAIL)
        assert probe["cached_tokens"] == probe["public_cached_tokens"] == 96
    finally:
        running.stop()


def test_a_cluster_ingress_names_the_public_blocks_as_the_replicas_do(tmp_path: Path) -> None:
    # the Ray Serve ingress routes by the digests a prompt will have in a replica's cache: it
    # reads the tenants file's public prefixes too (as `cluster.deployments` does), so the
    # declared blocks are named in the public namespace, the same for every permitted tenant
    (tmp_path / "secret").write_bytes(SECRET)
    argv = ["--model", MODEL, "--tenants", str(write_tenants(tmp_path)), "--secret-file",
            str(tmp_path / "secret"), "--block-size", str(BS), "--num-kv-blocks", "64"]  # fmt: skip
    running = start_server(argv)
    try:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(argv)
        tenants = tenant_registry(args)
        engine = running.engine
        declare_public_prefixes(args, tenants, engine.tokenizer, engine.model_config.vocab_size)
        digester = PromptDigester(engine.tokenizer, tenants, engine.cache_identity)

        def digests(tenant: str, prompt: str) -> list[bytes]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            return digester.digests("/v1/completions", KEYS[tenant], json.dumps(body).encode())

        a, b, c = (digests(t, MANUAL + SECRET_TAIL) for t in "abc")
        details(running, "a", MANUAL + SECRET_TAIL)
        cached = {blk.digest for blk in engine.cache.pool.blocks if blk.digest is not None}
        assert set(a) <= cached  # the very blocks the replica cached for a
        assert a[:6] == b[:6] and not set(a[6:]) & set(b)  # public, then each tenant's own
        assert not set(c) & set(a)  # c may not use the manual: its blocks are its own
    finally:
        running.stop()
