"""gateway/tenants.py and gateway/quotas.py, without a server: the tenant file's checks, key ->
tenant resolution, the `user` fallback, and the quotas' arithmetic (Retry-After exact, on a fake
clock)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from llmserve.gateway.quotas import Admission, QuotaExceeded, Quotas, TooLarge
from llmserve.gateway.tenants import (
    DEFAULT_TENANT,
    Caller,
    TenantError,
    TenantLimits,
    TenantTable,
    from_dict,
)

FILE: dict[str, Any] = {
    "default": {"weight": 1, "tokens_per_minute": 600},
    "tenants": {
        "acme": {"weight": 2, "tokens_per_minute": 60000, "max_concurrent_requests": 8},
        "beta": {"weight": 0.5},
    },
    "keys": [
        {"key": "sk-acme", "tenant": "acme", "name": "acme-prod"},
        {"key_sha256": hashlib.sha256(b"sk-beta").hexdigest(), "tenant": "beta"},
        {"key": "@beta2.key", "tenant": "beta", "name": "beta-file"},
        {"key": "sk-anyone"},
    ],
}


def write(tmp_path: Path, data: Any) -> Path:
    (tmp_path / "beta2.key").write_text("sk-beta-2\n")
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(data))
    return path


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_keys_name_tenants(tmp_path: Path) -> None:
    table = TenantTable.load(write(tmp_path, FILE), api_key="sk-single")
    assert table.requires_key
    assert table.resolve(bearer("sk-acme"), user="ignored") == Caller("acme", "acme-prod")
    assert table.resolve(bearer("sk-beta"), "") == Caller("beta", "beta#1")
    assert table.resolve(bearer("sk-beta-2"), "") == Caller("beta", "beta-file")
    assert table.resolve(bearer("sk-anyone"), "") == Caller(DEFAULT_TENANT, "default#3")
    # --api-key beside the file: one more key, the default tenant's.
    assert table.resolve(bearer("sk-single"), "") == Caller(DEFAULT_TENANT, "api-key")
    for wrong in (None, "", "Bearer", "Bearer sk-acm", "Basic sk-acme", "sk-acme"):
        assert table.find_key(wrong) is None, wrong
    assert table.limits("acme") == TenantLimits(2.0, 60000, 8)
    # A listed tenant's missing fields come from the default; unknown tenants get the default.
    assert table.limits("beta") == TenantLimits(0.5, 600, 0)
    assert table.limits("stranger") == table.limits(DEFAULT_TENANT) == TenantLimits(1.0, 600, 0)


def test_without_keys_the_user_field_names_the_tenant() -> None:
    table = TenantTable.single_key(None)
    assert not table.requires_key
    assert table.resolve(None, "alice") == Caller("alice")
    assert table.resolve(None, "") == Caller(DEFAULT_TENANT)
    assert table.resolve(None, "default") == Caller(DEFAULT_TENANT)
    assert table.limits("alice") == TenantLimits()
    with pytest.raises(TenantError, match="user has 129 characters; the limit is 128"):
        table.resolve(None, "x" * 129)
    with pytest.raises(TenantError, match="user='a\\\\nb' holds a control character"):
        table.resolve(None, "a\nb")
    # One --api-key: the default tenant's; the user field is not consulted.
    single = TenantTable.single_key("sk-1")
    assert single.resolve(bearer("sk-1"), "alice") == Caller(DEFAULT_TENANT, "api-key")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"extra": 1}, "extra is not a field of the tenant file"),
        ({"default": {"weight": 0}}, "default.weight=0 must be > 0"),
        ({"default": {"weight": "2"}}, "default.weight='2' must be a number"),
        ({"default": {"tpm": 5}}, r"default.tpm is not a field \(allowed: weight, "),
        (
            {"tenants": {"acme": {"tokens_per_minute": -1}}},
            "tenants.acme.tokens_per_minute=-1 must be an integer >= 0",
        ),
        (
            {"tenants": {"acme": {"max_concurrent_requests": 1.5}}},
            "tenants.acme.max_concurrent_requests=1.5 must be an integer >= 0",
        ),
        ({"tenants": {"default": {}}}, "set the default tenant's limits in 'default'"),
        ({"tenants": []}, "tenants must be a JSON object"),
        ({"keys": {}}, "keys must be a JSON list"),
        ({"keys": [{"tenant": "acme"}]}, r"keys\[0\] needs exactly one of key and key_sha256"),
        ({"keys": [{"key": "a", "key_sha256": "b"}]}, "needs exactly one of key and key_sha256"),
        ({"keys": [{"key": " "}]}, r"keys\[0\].key is empty"),
        ({"keys": [{"key": 5}]}, r"keys\[0\].key must be a string"),
        ({"keys": [{"key_sha256": "abc"}]}, r"keys\[0\].key_sha256 must be 64 hex digits"),
        ({"keys": [{"key": "k", "tenant": "acmee"}]}, r"keys\[0\].tenant='acmee' is not in"),
        ({"keys": [{"key": "@missing.key"}]}, r"keys\[0\].key='@missing.key': No such file"),
        ({"keys": [{"key": "k"}, {"key": "k"}]}, "is the same secret as key"),
        ({"keys": [{"key": "a", "name": "n"}, {"key": "b", "name": "n"}]}, "two keys are named"),
    ],
)
def test_tenant_file_errors_name_the_field(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    data = {"tenants": {"acme": {}}, **change}
    with pytest.raises(TenantError, match=message):
        TenantTable.load(write(tmp_path, data))


def test_unreadable_or_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(TenantError, match=r"api_keys='.*nope\.json' cannot be read"):
        TenantTable.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(TenantError, match="is not valid JSON"):
        TenantTable.load(bad)
    with pytest.raises(TenantError, match="must be a JSON object, not list"):
        from_dict([])


def test_run_time_changes() -> None:
    table = from_dict({"default": {"tokens_per_minute": 100}, "tenants": {"acme": {}}})
    assert table.set_weight("acme", 3) == TenantLimits(3.0, 100, 0)
    assert table.set_quota("acme", None, 4) == TenantLimits(3.0, 100, 4)
    # An unlisted tenant starts from the default's limits and is listed from then on.
    assert table.set_quota("new", 0, None) == TenantLimits(1.0, 0, 0)
    assert "new" in table.tenants
    # The default tenant's change applies to every unlisted tenant.
    table.set_weight(DEFAULT_TENANT, 5)
    assert table.limits("stranger").weight == 5.0
    with pytest.raises(TenantError, match="weight=0 must be > 0"):
        table.set_weight("acme", 0)
    with pytest.raises(TenantError, match="tokens_per_minute=-5 must be an integer >= 0"):
        table.set_quota("acme", -5, None)
    assert table.limits("acme") == TenantLimits(3.0, 100, 4)  # unchanged by the refusals


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def quotas(tpm: int = 0, concurrent: int = 0) -> tuple[Quotas, Clock]:
    clock = Clock()
    table = TenantTable(tenants={"t": TenantLimits(1.0, tpm, concurrent)})
    return Quotas(table, clock), clock


def test_tokens_per_minute_bucket_and_exact_retry_after() -> None:
    q, clock = quotas(tpm=600)  # 10 tokens a second, 600 at most
    first = q.admit("t", [400, 200])  # reserves 600: the bucket is empty
    clock.now += 2  # 20 tokens back
    with pytest.raises(QuotaExceeded) as err:
        q.admit("t", [100])
    # (100 - 20) / 10 = 8 s.
    assert err.value.retry_after_s == 8
    assert err.value.reason == "tokens_per_minute"
    assert err.value.message == (
        "tenant 't' is over its quota of tokens_per_minute=600: this request reserves 100 "
        "tokens (prompt + max_tokens), 20 are left"
    )
    clock.now += 7.5  # 95 tokens: still 0.5 s short, rounded up to 1
    with pytest.raises(QuotaExceeded) as err:
        q.admit("t", [100])
    assert err.value.retry_after_s == 1
    # The first request used 250 of its 600: 350 come back at once.
    first.use(250)
    first.release()
    assert q.usage["t"].level == pytest.approx(95 + 350)
    second = q.admit("t", [100])
    assert q.usage["t"].level == pytest.approx(345)
    second.release()  # used nothing (never reached a scheduler): all 100 back
    assert q.usage["t"].level == pytest.approx(445)
    clock.now += 3600
    assert q.admit("t", [1]).reserved == 1 and q.usage["t"].level == 599  # full, capped


def test_a_request_larger_than_the_quota_is_never_admitted() -> None:
    q, _ = quotas(tpm=600, concurrent=2)
    with pytest.raises(TooLarge) as err:
        q.admit("t", [300, 301])
    assert str(err.value) == (
        "prompt tokens + max_tokens = 601 exceeds the quota of tenant 't', "
        "tokens_per_minute=600; lower max_tokens"
    )
    with pytest.raises(TooLarge) as err:
        q.admit("t", [1, 1, 1])
    assert str(err.value) == (
        "n=3 sequences at once exceed the quota of tenant 't', max_concurrent_requests=2"
    )
    assert q.usage["t"].level == 600 and q.usage["t"].num_in_flight == 0  # nothing reserved


def test_concurrency_quota_and_its_retry_after() -> None:
    q, clock = quotas(concurrent=2)
    a = q.admit("t", [10])
    b = q.admit("t", [10])
    with pytest.raises(QuotaExceeded) as err:
        q.admit("t", [10])
    assert err.value.retry_after_s == 1  # no request has finished yet: 1 s
    assert err.value.message == (
        "tenant 't' has 2 requests in flight; its quota is max_concurrent_requests=2"
    )
    clock.now += 10
    a.release()  # took 10 s
    c = q.admit("t", [10])  # admitted at 1010
    clock.now += 3
    with pytest.raises(QuotaExceeded) as err:
        q.admit("t", [10])
    # The mean duration is 10 s; the oldest in flight (b) is 13 s old: 1 s at least.
    assert err.value.retry_after_s == 1
    b.release()  # 13 s: the mean becomes 10 + 0.2 * 3 = 10.6
    clock.now += 1
    with pytest.raises(QuotaExceeded) as err:
        q.admit("t", [5, 5])
    # c is the oldest, 4 s old: 10.6 - 4 = 6.6, rounded up.
    assert err.value.retry_after_s == 7
    c.release()
    assert q.num_in_flight("t") == 0


def test_unlimited_tenants_are_forgotten_when_idle_and_release_is_idempotent() -> None:
    q, _ = quotas()
    admission: Admission = q.admit("someone", [5])
    assert q.num_in_flight("someone") == 1 and admission.reserved == 0
    admission.release()
    admission.release()
    assert "someone" not in q.usage


def test_a_new_limit_starts_full_and_a_lower_one_clamps() -> None:
    q, clock = quotas(tpm=0)
    q.admit("t", [1000]).release()  # no limit: anything goes
    q.table.set_quota("t", 120, None)
    a = q.admit("t", [100])  # starts full at 120
    assert q.usage["t"].level == 20
    q.table.set_quota("t", 10, None)
    clock.now += 1  # 22 tokens (2 s at the old rate), clamped to 10
    b = q.admit("t", [10])
    assert q.usage["t"].level == 0
    with pytest.raises(QuotaExceeded) as err:
        q.admit("t", [5])
    assert err.value.retry_after_s == 30  # 5 / (10 / 60)
    a.release()
    b.release()


def test_idle_tenants_with_full_buckets_are_swept() -> None:
    from llmserve.gateway.quotas import SWEEP_EVERY

    clock = Clock()
    q = Quotas(TenantTable(default=TenantLimits(1.0, 60, 0)), clock)
    q.admit("busy", [10])  # stays in flight
    for i in range(SWEEP_EVERY - 2):
        admission = q.admit(f"user-{i}", [10])
        admission.use(10)
        admission.release()  # each leaves its bucket 10 short
    assert len(q.usage) == SWEEP_EVERY - 1
    clock.now += 9  # 9 tokens back: not yet full
    q.admit("one-more", [1]).release()  # the sweep runs before this admission
    assert len(q.usage) == SWEEP_EVERY
    clock.now += 1
    for _ in range(SWEEP_EVERY):
        q.admit("one-more", [1]).release()
    assert set(q.usage) == {"busy", "one-more"}


def test_bearer_values_and_secrets_read_from_files(tmp_path: Path) -> None:
    """One parse of `Authorization: Bearer TOKEN` (common.auth) serves the internal token, the
    admin key and the client keys; a secret written @PATH is read relative to a base."""
    from llmserve.common.auth import bearer_metadata, bearer_token, is_authorized, read_secret

    assert bearer_token("Bearer sk-1") == bearer_token("  bearer   sk-1 ") == "sk-1"
    for wrong in (None, "", "Bearer", "Bearer  ", "Basic sk-1", "sk-1"):
        assert bearer_token(wrong) is None, wrong
    assert is_authorized("Bearer sk-1", "sk-1") and not is_authorized("Basic sk-1", "sk-1")
    assert not is_authorized("Bearer sk-12", "sk-1") and not is_authorized(None, "sk-1")
    assert bearer_metadata("sk-1") == (("authorization", "Bearer sk-1"),)
    assert bearer_metadata(None) == bearer_metadata("") == ()
    (tmp_path / "key").write_text("sk-file\n")
    assert read_secret("@key", base=tmp_path) == "sk-file"
    assert read_secret(f"@{tmp_path / 'key'}") == "sk-file"  # an absolute path ignores base
    assert read_secret("sk-plain", base=tmp_path) == "sk-plain"
    assert read_secret(None) is None and read_secret("") is None
    with pytest.raises(OSError):
        read_secret("@missing", base=tmp_path)


def test_a_key_is_found_once_by_its_digest(tmp_path: Path) -> None:
    """find_key: one SHA-256 of the presented key, looked up among the keys by digest; caller
    names the tenant of the key found (the interceptor's or the middleware's) without a second
    lookup, and resolve is the two together."""
    table = TenantTable.load(write(tmp_path, FILE), api_key="sk-single")
    key = table.find_key(bearer("sk-acme"))
    assert key is not None and key.sha256 == hashlib.sha256(b"sk-acme").digest()
    assert table.keys[key.sha256] is key
    assert table.caller(key, "ignored") == Caller("acme", "acme-prod")
    assert table.caller(None, "alice") == Caller(DEFAULT_TENANT)  # keys: user not consulted
    assert TenantTable.single_key(None).caller(None, "alice") == Caller("alice")
    with pytest.raises(TenantError, match="key 'api-key' is the same secret as key 'acme-prod'"):
        TenantTable.load(write(tmp_path, FILE), api_key="sk-acme")
