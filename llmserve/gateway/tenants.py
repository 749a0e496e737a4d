"""Who a request is for: the tenant table (`--api-keys FILE`), the keys that name tenants, and the
tenant of a request, from its API key or, with no keys configured, from its `user` field.

The file's format, the default tenant ("" on the wire, "default" in the file) and per-tenant
`lora_adapters`: docs/tenants.md#the-tenant-file. A presented key is looked up once per request
(by the gRPC interceptor or the HTTP middleware): one SHA-256, then a dict lookup by digest
(`TenantTable.find_key` says why that needs no constant-time compare). `load_tenants` reads
and checks the file once per process: `llmserve serve` before anything starts, the gateway
before its tokenizer loads (it hands the table to its GatewayCore).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmserve.common.auth import bearer_token, read_secret
from llmserve.gateway.config import GatewayConfig

DEFAULT_TENANT = ""
DEFAULT_NAME = "default"  # how files, the CLI and logs spell the default tenant
MAX_TENANT_CHARS = 128
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_LIMIT_FIELDS = ("weight", "tokens_per_minute", "max_concurrent_requests")


class TenantError(ValueError):
    """A tenant file or value that is not valid; the message names the field."""


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's weight under the fair policy and its quotas at the gateway (0: no limit)."""

    weight: float = 1.0
    tokens_per_minute: int = 0
    max_concurrent_requests: int = 0
    # The LoRA adapters it may use (None: any served).
    lora_adapters: frozenset[str] | None = None

    def __post_init__(self) -> None:
        check_limits("", vars(self))

    def may_use(self, lora_name: str) -> bool:
        return not lora_name or self.lora_adapters is None or lora_name in self.lora_adapters


def check_limits(where: str, values: dict[str, Any]) -> None:
    """Raise TenantError naming the first bad value of weight, tokens_per_minute and
    max_concurrent_requests (where: a prefix such as "tenants.acme.")."""
    weight = values["weight"]
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise TenantError(f"{where}weight={weight!r} must be a number")
    if not (math.isfinite(weight) and weight > 0):
        raise TenantError(f"{where}weight={weight!r} must be > 0")
    for name in ("tokens_per_minute", "max_concurrent_requests"):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TenantError(f"{where}{name}={value!r} must be an integer >= 0 (0: no limit)")
        if value >= 1 << 31 and name == "max_concurrent_requests":
            raise TenantError(f"{where}{name}={value} must be < 2**31")


def tenant_name(value: str, where: str = "tenant") -> str:
    """value as a tenant name ("default" and "" are the default tenant's); TenantError when it is
    too long or holds control characters."""
    if value == DEFAULT_NAME:
        return DEFAULT_TENANT
    if len(value) > MAX_TENANT_CHARS:
        raise TenantError(f"{where} has {len(value)} characters; the limit is {MAX_TENANT_CHARS}")
    if any(not c.isprintable() for c in value):
        raise TenantError(f"{where}={value[:40]!r} holds a control character")
    return value


def display_name(tenant: str) -> str:
    return tenant or DEFAULT_NAME


@dataclass(frozen=True)
class ApiKey:
    """One client key: the SHA-256 of its secret, the tenant it stands for, a name for logs."""

    sha256: bytes
    tenant: str
    name: str


@dataclass(frozen=True)
class Caller:
    """Who sent a request: its tenant and the name of the key it presented ("" without one)."""

    tenant: str
    key_name: str = ""


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class TenantTable:
    """The tenants' limits (changed at run time by the Admin API) and the client keys.

    `limits(tenant)` is a listed tenant's limits, else the default's. `resolve` names the caller
    of a request. No I/O after construction.
    """

    def __init__(
        self,
        default: TenantLimits | None = None,
        tenants: dict[str, TenantLimits] | None = None,
        keys: list[ApiKey] | None = None,
    ):
        self.default = default or TenantLimits()
        self.tenants: dict[str, TenantLimits] = dict(tenants or {})
        self.keys: dict[bytes, ApiKey] = _by_digest(keys or [])

    @property
    def requires_key(self) -> bool:
        return bool(self.keys)

    def limits(self, tenant: str) -> TenantLimits:
        if tenant == DEFAULT_TENANT:
            return self.default
        return self.tenants.get(tenant, self.default)

    def find_key(self, authorization: str | None) -> ApiKey | None:
        """The key an Authorization value carries, or None: one digest, one dict lookup.

        The lookup is not constant-time: hashing the digest into the dict and comparing it with
        a stored one may take longer the more leading bytes they share. That reveals at most
        something about the stored digests, never about the secrets: SHA-256 is
        preimage-resistant, so a caller can neither steer the bytes of the digest it presents
        nor turn a known digest into a key. The secret itself is never compared."""
        token = bearer_token(authorization)
        return self.keys.get(_digest(token)) if token is not None else None

    def caller(self, key: ApiKey | None, user: str) -> Caller:
        """The caller of a request that presented key (find_key's answer): with keys, its
        tenant (the middleware or the interceptor has refused a request without one); without
        keys, its `user` field's. Raises TenantError for a `user` that cannot name a tenant."""
        if self.keys:
            return Caller(key.tenant, key.name) if key is not None else Caller(DEFAULT_TENANT)
        return Caller(tenant_name(user, "user"))

    def resolve(self, authorization: str | None, user: str) -> Caller:
        """caller() of the key an Authorization value carries."""
        return self.caller(self.find_key(authorization), user)

    def set_weight(self, tenant: str, weight: float) -> TenantLimits:
        return self._set(tenant, weight=weight)

    def set_quota(
        self, tenant: str, tokens_per_minute: int | None, max_concurrent_requests: int | None
    ) -> TenantLimits:
        changes: dict[str, Any] = {}
        if tokens_per_minute is not None:
            changes["tokens_per_minute"] = tokens_per_minute
        if max_concurrent_requests is not None:
            changes["max_concurrent_requests"] = max_concurrent_requests
        return self._set(tenant, **changes)

    def _set(self, tenant: str, **changes: Any) -> TenantLimits:
        """tenant's limits with changes (a tenant not listed starts from the default's; the
        default tenant's change applies to every unlisted one). TenantError on a bad value."""
        limits = self.limits(tenant)
        merged = {name: changes.get(name, getattr(limits, name)) for name in _LIMIT_FIELDS}
        check_limits("", merged)
        new = replace(limits, **changes)
        if tenant == DEFAULT_TENANT:
            self.default = new
        else:
            self.tenants[tenant] = new
        return new

    @classmethod
    def load(cls, path: str | Path, api_key: str | None = None) -> TenantTable:
        """The table of a tenant file (see the module's docstring); api_key, when given, is one
        more key, the default tenant's. TenantError naming the field on anything unexpected."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as err:
            raise TenantError(f"api_keys={str(path)!r} cannot be read: {err.strerror}") from err
        except json.JSONDecodeError as err:
            raise TenantError(f"api_keys={str(path)!r} is not valid JSON: {err}") from err
        table = from_dict(data, base=Path(path).parent)
        if api_key:
            keys = [*table.keys.values(), ApiKey(_digest(api_key), DEFAULT_TENANT, "api-key")]
            table = cls(table.default, table.tenants, keys)
        return table

    @classmethod
    def single_key(cls, api_key: str | None) -> TenantTable:
        """No tenant file: the one --api-key (if any) is the default tenant's."""
        keys = [ApiKey(_digest(api_key), DEFAULT_TENANT, "api-key")] if api_key else []
        return cls(keys=keys)


def _object(value: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TenantError(f"{where} must be a JSON object, not {type(value).__name__}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise TenantError(
            f"{where}.{unknown[0]} is not a field (allowed: {', '.join(allowed)})"
            if where
            else f"{unknown[0]} is not a field of the tenant file (allowed: {', '.join(allowed)})"
        )
    return value


def _limits(value: Any, where: str, base: TenantLimits) -> TenantLimits:
    fields = _object(value, where, (*_LIMIT_FIELDS, "lora_adapters"))
    merged = {name: fields.get(name, getattr(base, name)) for name in _LIMIT_FIELDS}
    check_limits(f"{where}.", merged)
    adapters = fields.get("lora_adapters", base.lora_adapters)
    if adapters is not None:
        if not isinstance(adapters, list | frozenset) or not all(
            isinstance(a, str) and a for a in adapters
        ):
            raise TenantError(f"{where}.lora_adapters must be a list of adapter names")
        adapters = frozenset(adapters)
    return TenantLimits(**{**merged, "weight": float(merged["weight"])}, lora_adapters=adapters)


def from_dict(data: Any, base: Path = Path(".")) -> TenantTable:
    """The table a tenant file's JSON describes; relative @PATHs are read from base."""
    top = _object(data, "", ("default", "tenants", "keys"))
    default = _limits(top.get("default", {}), "default", TenantLimits())
    tenants_field = top.get("tenants", {})
    if not isinstance(tenants_field, dict):
        raise TenantError("tenants must be a JSON object of tenant name -> limits")
    tenants = {}
    for name, value in tenants_field.items():
        if tenant_name(name, f"tenants.{name[:40]}") == DEFAULT_TENANT:
            raise TenantError(f"tenants.{name!r}: set the default tenant's limits in 'default'")
        tenants[name] = _limits(value, f"tenants.{name}", default)
    keys_field = top.get("keys", [])
    if not isinstance(keys_field, list):
        raise TenantError("keys must be a JSON list of {key | key_sha256, tenant, name}")
    keys = [_key(entry, i, set(tenants), base) for i, entry in enumerate(keys_field)]
    return TenantTable(default, tenants, keys)


def _key(value: Any, i: int, tenants: set[str], base: Path) -> ApiKey:
    where = f"keys[{i}]"
    entry = _object(value, where, ("key", "key_sha256", "tenant", "name"))
    if ("key" in entry) == ("key_sha256" in entry):
        raise TenantError(f"{where} needs exactly one of key and key_sha256")
    for field in ("key", "key_sha256", "tenant", "name"):
        if field in entry and not isinstance(entry[field], str):
            raise TenantError(f"{where}.{field} must be a string")
    if "key" in entry:
        try:
            secret = read_secret(entry["key"], base)
        except OSError as err:
            raise TenantError(f"{where}.key={entry['key']!r}: {err.strerror}") from err
        if secret is None or not secret.strip():
            raise TenantError(f"{where}.key is empty")
        digest = _digest(secret)
    else:
        hex_digest = entry["key_sha256"].lower()
        if not _SHA256_HEX.fullmatch(hex_digest):
            raise TenantError(f"{where}.key_sha256 must be 64 hex digits (sha256sum of the key)")
        digest = bytes.fromhex(hex_digest)
    tenant = tenant_name(entry.get("tenant", DEFAULT_NAME), f"{where}.tenant")
    if tenant and tenant not in tenants:
        raise TenantError(
            f"{where}.tenant={tenant!r} is not in tenants (list it there, or leave tenant out "
            "for the default tenant)"
        )
    return ApiKey(digest, tenant, entry.get("name") or f"{display_name(tenant)}#{i}")


def _by_digest(keys: list[ApiKey]) -> dict[bytes, ApiKey]:
    """keys by digest; TenantError when two are the same secret or share a name."""
    found: dict[bytes, ApiKey] = {}
    names: set[str] = set()
    for key in keys:
        if key.sha256 in found:
            raise TenantError(
                f"key {key.name!r} is the same secret as key {found[key.sha256].name!r}"
            )
        if key.name in names:
            raise TenantError(f"two keys are named {key.name!r}; key names must be unique")
        found[key.sha256] = key
        names.add(key.name)
    return found


def load_tenants(config: GatewayConfig) -> TenantTable:
    """The gateway's tenant table: --api-keys FILE (with --api-key as one more key, the default
    tenant's) or just --api-key. ValueError (TenantError) naming the field when the file is
    wrong, or when the admin key is also a client key."""
    api_key = config.api_key
    if config.api_keys:
        table = TenantTable.load(config.api_keys, api_key)
    else:
        table = TenantTable.single_key(api_key)
    try:
        admin = config.admin_secret()
    except OSError as err:
        raise TenantError(f"admin_key={config.admin_key!r} cannot be read: {err.strerror}") from err
    if admin is not None and _digest(admin.strip()) in table.keys:
        raise TenantError("admin_key is also a client key: a client key must not open Admin")
    return table
