"""Tenant isolation: the tenants file, salt derivation, and a real server with
examples/tenants.toml (401s, per-tenant reuse, group sharing, mode none, admin reset, 429 and
client disconnects)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.server.tenancy import (
    TenancyError,
    Tenant,
    TenantRegistry,
    encode_salt_input,
    load_secret,
    load_tenants,
)
from server_harness import RunningServer, start_server, wait_idle

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
MODEL = "tiny"
ACME, OPS = "sk-acme-example-key-1", "sk-ops-admin-example-key"
GLOBEX, INITECH, HOSPITAL = "sk-globex-example-key", "sk-initech-example-key", (
    "sk-hospital-example-key")
NUM_KV_BLOCKS = 128
SECRET = b"0123456789abcdef0123456789abcdef"

# ---- unit: tenants file and salts -----------------------------------------------------------


def test_example_tenants_file_parses() -> None:
    by_key = load_tenants(EXAMPLE)
    assert by_key[ACME] == by_key["sk-acme-example-key-2"] == Tenant("acme", "tenant",
                                                                     max_pinned_blocks=64)
    assert by_key[GLOBEX].isolation_domain == by_key[INITECH].isolation_domain == "group:partners"
    assert by_key[HOSPITAL].mode == "none" and by_key[OPS].admin


@pytest.mark.parametrize(("text", "fragment"), [
    ("[tenants.a]\napi_keys = ['short']\n", "api_keys"),
    ("[tenants.a]\napi_keys = ['long-enough-key']\nisolation = 'group:'\n", "isolation"),
    ("[tenants.a]\napi_keys = ['long-enough-key']\nisolation = 'shared!'\n", "isolation"),
    ("[tenants.a]\napi_keys = ['long-enough-key']\nadmin = 'yes'\n", "admin"),
    ("[tenants.a]\napi_keys = ['long-enough-key']\ncolour = 'red'\n", "unknown field"),
    ("[tenants.a]\napi_keys = ['long-enough-key']\n[tenants.b]\napi_keys = ['long-enough-key']\n",
     "also used"),
    ("[other]\nx = 1\n", "[tenants.<id>]"),
    ("tenants = [", "not valid TOML"),
])
def test_bad_tenants_files_are_rejected(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    with pytest.raises(TenancyError, match=None) as info:
        load_tenants(path)
    assert fragment in str(info.value)


def test_salt_encoding_is_unambiguous() -> None:
    a = encode_salt_input(Tenant("org_1"), "2345")
    b = encode_salt_input(Tenant("org_12345"), "")
    c = encode_salt_input(Tenant("org_12345"), None)
    tenant_x = encode_salt_input(Tenant("x", "tenant"), None)
    group_x = encode_salt_input(Tenant("y", "group:x"), None)
    assert len({a, b, c, tenant_x, group_x}) == 5


def test_effective_salt_scopes() -> None:
    registry = TenantRegistry({"k" * 8: Tenant("a")}, SECRET)
    a, b = Tenant("a"), Tenant("b")
    g1, g2 = Tenant("g1", "group:team"), Tenant("g2", "group:team")
    assert registry.scope(a, "s").salt != registry.scope(b, "s").salt
    assert registry.scope(a, "s").salt != registry.scope(a, None).salt
    assert registry.scope(g1, None) == registry.scope(g2, None)
    assert registry.scope(Tenant("n", "none"), None).use_cache is False
    other = TenantRegistry({}, SECRET[::-1])
    assert other.scope(a, None).salt != registry.scope(a, None).salt
    assert registry.authenticate("k" * 8) == a and registry.authenticate("nope") is None
    trusted = TenantRegistry(None, SECRET)
    assert trusted.scope(a, "s").salt == "s" and trusted.authenticate(None).admin


def test_secret_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFIXCACHE_SECRET", raising=False)
    assert load_secret(None)[1] == "random" and load_secret(None)[0] != load_secret(None)[0]
    monkeypatch.setenv("PREFIXCACHE_SECRET", "s" * 20)
    assert load_secret(None) == (b"s" * 20, "env")
    (tmp_path / "secret").write_bytes(b"short\n")
    with pytest.raises(TenancyError, match="at least 16 bytes"):
        load_secret(str(tmp_path / "secret"))
    with pytest.raises(TenancyError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))


# ---- end to end -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.write_bytes(SECRET)
    running = start_server(["--model", MODEL, "--tenants", str(EXAMPLE), "--secret-file",
                            str(secret), "--num-kv-blocks", str(NUM_KV_BLOCKS),
                            "--max-num-seqs", "2", "--max-queue-len", "0"])
    yield running
    running.stop()


def client_for(server: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def cached(server: RunningServer, key: str, prompt: str, salt: str | None = None) -> int:
    extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
    out = client_for(server, key).completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0, extra_body=extra)
    return out.usage.prompt_tokens_details.cached_tokens


def secret_prompt() -> str:
    return (f"confidential {uuid.uuid4().hex} " * 8)[:100]  # 101 tokens: 96 reusable


def test_missing_or_unknown_key_is_401(server: RunningServer) -> None:
    for key in (None, "sk-not-a-tenant"):
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        response = httpx.post(server.base_url + "/v1/completions", headers=headers,
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert cached(server, ACME, "hello") == 0


def test_reuse_stays_inside_a_tenant(server: RunningServer) -> None:
    prompt = secret_prompt()
    assert cached(server, ACME, prompt, salt="acme-salt") == 0
    assert cached(server, "sk-acme-example-key-2", prompt, salt="acme-salt") == 96
    # another tenant copying acme's salt gets nothing, with or without it
    assert cached(server, OPS, prompt, salt="acme-salt") == 0
    assert cached(server, OPS, prompt) == 0
    # a different salt narrows acme's own sharing
    assert cached(server, ACME, prompt, salt="other") == 0


def test_group_members_share(server: RunningServer) -> None:
    prompt = secret_prompt()
    assert cached(server, GLOBEX, prompt) == 0
    assert cached(server, INITECH, prompt) == 96
    assert cached(server, ACME, prompt) == 0


def test_isolation_none_neither_reads_nor_writes(server: RunningServer) -> None:
    prompt = secret_prompt()
    stats = server.engine.cache.stats
    committed = stats.num_committed_blocks
    assert cached(server, HOSPITAL, prompt) == 0
    assert cached(server, HOSPITAL, prompt) == 0
    assert stats.num_committed_blocks == committed


def test_reset_needs_admin(server: RunningServer) -> None:
    url = server.base_url + "/reset_prefix_cache"
    assert httpx.post(url).status_code == 401
    forbidden = httpx.post(url, headers={"authorization": f"Bearer {ACME}"})
    assert forbidden.status_code == 403 and "admin" in forbidden.json()["error"]["message"]
    prompt = secret_prompt()
    cached(server, OPS, prompt)
    wait_idle(server)
    done = httpx.post(url, headers={"authorization": f"Bearer {OPS}"})
    assert done.status_code == 200 and done.json() == {"reset": True, "pins_released": 0}
    assert cached(server, OPS, prompt) == 0


def test_metrics_label_domains_not_prompts(server: RunningServer) -> None:
    prompt = secret_prompt()
    cached(server, GLOBEX, prompt)
    url = server.base_url + "/metrics"
    assert httpx.get(url).status_code == 401  # tenant names and traffic: not for anyone
    denied = httpx.get(url, headers={"Authorization": f"Bearer {ACME}"})
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
    text = httpx.get(url, headers={"Authorization": f"Bearer {OPS}"}).text
    domains = {sample.labels.get("domain") for family in text_string_to_metric_families(text)
               for sample in family.samples if "domain" in sample.labels}
    assert {"tenant:acme", "group:partners", "none"} <= domains
    assert prompt[:20] not in text and "confidential" not in text


def test_queue_full_is_429_and_disconnect_aborts(server: RunningServer) -> None:
    acme = client_for(server, ACME)
    streams = [client_for(server, key).completions.create(
        model=MODEL, prompt=secret_prompt(), max_tokens=1500, stream=True, temperature=0.0,
        extra_body={"ignore_eos": True}) for key in (ACME, GLOBEX)]
    for stream in streams:  # both are running: each produced a first chunk
        next(iter(stream))
    with pytest.raises(openai.RateLimitError) as info:  # the server's queue is full
        client_for(server, HOSPITAL).completions.create(model=MODEL, prompt="one", max_tokens=2)
    assert info.value.status_code == 429 and "at its limit" in info.value.body["message"]
    with pytest.raises(openai.RateLimitError) as info:  # and acme holds its half of it
        acme.completions.create(model=MODEL, prompt="one more", max_tokens=2)
    assert "this caller" in info.value.body["message"]
    for stream in streams:
        stream.close()
    wait_idle(server)
    assert server.engine.cache.num_free_blocks == NUM_KV_BLOCKS
    time.sleep(0.1)
    assert cached(server, ACME, "after the burst") == 0


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--tenants", "/nonexistent/tenants.toml"], "cannot read tenants file"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--model", "/nonexistent/model"], "neither a built-in model"),
])
def test_serve_cli_user_errors_are_one_line(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixcache.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", "1", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("prefixcache serve: error:") and fragment in err[-1]
