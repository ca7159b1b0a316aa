"""Tenants at the router: API keys -> tenant, per-tenant token-bucket rate limits, weighted fair sharing under overload.

Identity: a client sends its key as `authorization: Bearer KEY` (or `x-api-key: KEY`) metadata. The router keeps only
SHA-256 digests of the keys (from config) and compares digests in constant time; a key is never stored in clear,
never logged and never echoed in an error. With no tenants configured every request is the "default" tenant; with
tenants configured and `require_api_key` (the default) a request without a known key is UNAUTHENTICATED.

Rate limit: a tenant with `rate_rps` has a token bucket (`burst` deep, refilled at `rate_rps` on the wall clock); a
request finding it empty is RESOURCE_EXHAUSTED with the wait until the next token as its retry hint.

Fair sharing (per model): the router learns the model's concurrency at saturation, `capacity`, as the number of its
requests in flight whenever the admission policy sheds one (a moving average; while no shed happens for a
contention window the estimate grows by one per window, so it follows a node that got faster). While the model is
contended (the policy shed a request of it, or a tenant was held back, within the last `contention_window_s`), a
tenant may hold at most
    allowance(t) = max(share(t) / 2, capacity - sum over the other active tenants o of (1.25 * peak(o) + 2))
requests, where share(t) = capacity * weight(t) / sum of active weights and peak(o) is o's recent peak in flight
(halving every 2 s), so the room kept for o covers its bursts. Only the tenant asking the most (recent requests per
unit of weight, also halving every 2 s) is held back. So a tenant asking within its share is never refused for
fairness and keeps room for its bursts, a flooding one keeps at least half its share, and capacity a quiet tenant
does not use stays with whoever wants it (work conserving). A request over its tenant's
allowance is RESOURCE_EXHAUSTED ("over its fair share") with the policy's minimum retry hint.

Invariant: every `admit` that returns is followed by exactly one `release(request_id)`.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from octoserve.services.core.errors import Overloaded, Unauthenticated
from octoserve.services.core.types import Priority

DEFAULT_TENANT = "default"
CAPACITY_EWMA = 0.2
ACTIVE_WINDOW_S = 2.0
HALF_LIFE_S = 2.0
MIN_SHARE_FRACTION = 0.5  # a tenant held back keeps at least this fraction of its weighted share


@dataclass(frozen=True, slots=True)
class TenantSpec:
    name: str
    key_sha256: tuple[str, ...] = ()  # hex digests of the tenant's API keys
    weight: float = 1.0
    rate_rps: float | None = None  # None: no rate limit
    burst: int = 0  # bucket depth; 0: max(1, rate_rps)


@dataclass(frozen=True, slots=True)
class TenantSettings:
    tenants: tuple[TenantSpec, ...] = ()
    require_api_key: bool = True
    contention_window_s: float = 1.0


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def tenant_settings_from_dict(d: Mapping | None) -> TenantSettings:
    """The `tenants:` config section: {require_api_key, contention_window_s, list: [{name, key | key_sha256 | keys,
    weight, rate_rps, burst}]}; raises ValueError naming the bad entry (never printing a key)."""
    if not d:
        return TenantSettings()
    known = {"require_api_key", "contention_window_s", "list"}
    if unknown := set(d) - known:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in tenants; known: {sorted(known)}")
    specs, seen = [], set()
    for i, t in enumerate(d.get("list") or ()):
        name = t.get("name")
        if not name or name in seen:
            raise ValueError(f"tenants.list[{i}]: every tenant needs a unique name")
        seen.add(name)
        digests = [hash_key(k) for k in ([t["key"]] if "key" in t else []) + list(t.get("keys", ()))]
        digests += [h.lower() for h in ([t["key_sha256"]] if "key_sha256" in t else [])]
        weight = float(t.get("weight", 1.0))
        rate = t.get("rate_rps")
        if not weight > 0 or (rate is not None and not float(rate) > 0):
            raise ValueError(f"tenant {name!r}: weight and rate_rps must be positive")
        specs.append(TenantSpec(name, tuple(digests), weight, None if rate is None else float(rate),
                                int(t.get("burst", 0))))
    return TenantSettings(tuple(specs), bool(d.get("require_api_key", True)), float(d.get("contention_window_s", 1.0)))


class TokenBucket:
    def __init__(self, rate_rps: float, burst: int, now: float) -> None:
        self.rate = rate_rps
        self.capacity = float(burst or max(1, int(rate_rps)))
        self.tokens = self.capacity
        self.stamp = now

    def take(self, now: float) -> float:
        """0 when a token was taken, else the seconds until one is available."""
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass
class _ModelShare:
    capacity: float = 0.0  # learned in-flight count at saturation; 0: not learned yet
    contended_until: float = 0.0
    last_probe: float = 0.0  # last policy shed or upward capacity probe
    in_flight: dict[str, int] = field(default_factory=dict)  # tenant -> requests in flight
    peak: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (decaying peak in flight, when)
    asks: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (decaying request count, when)
    last_seen: dict[str, float] = field(default_factory=dict)  # tenant -> last request time


class TenantGate:
    def __init__(self, settings: TenantSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._by_digest = {h: t for t in settings.tenants for h in t.key_sha256}
        self._weights = {t.name: t.weight for t in settings.tenants}
        self._buckets = {t.name: TokenBucket(t.rate_rps, t.burst, clock()) for t in settings.tenants if t.rate_rps}
        self._models: dict[str, _ModelShare] = {}
        self._held: dict[str, tuple[str, str]] = {}  # request_id -> (model, tenant)

    @property
    def enabled(self) -> bool:
        return bool(self.settings.tenants)

    def identify(self, metadata: Iterable[tuple[str, str]] | None) -> str:
        key = _key_from(metadata)
        if key is not None:
            digest = hash_key(key)
            for known, tenant in self._by_digest.items():
                if hmac.compare_digest(known, digest):
                    return tenant.name
            if self.settings.require_api_key and self.settings.tenants:
                raise Unauthenticated("the API key is not known to this node; check the key your operator issued")
        elif self.settings.require_api_key and self.settings.tenants:
            raise Unauthenticated("this node requires an API key; send it as `authorization: Bearer <key>` metadata")
        return DEFAULT_TENANT

    def admit(self, tenant: str, model: str, tier: Priority, request_id: str, retry_floor_ms: int) -> None:
        """Rate limit, then fair share; raises Overloaded, or holds a slot until `release(request_id)`."""
        if not self.enabled:
            return
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is not None and (wait_s := bucket.take(now)) > 0:
            raise Overloaded(model, tier, max(retry_floor_ms, int(wait_s * 1000) + 1),
                             f"tenant {tenant!r} is over its rate limit of {bucket.rate:g} req/s")
        share = self._models.setdefault(model, _ModelShare())
        share.last_seen[tenant] = now
        share.asks[tenant] = (self._decayed(share.asks, tenant, now) + 1.0, now)
        if now < share.contended_until and share.capacity > 0:
            window = self.settings.contention_window_s
            if now - share.last_probe > window:  # no shed for a window: probe for more capacity (additive increase)
                share.capacity += 1.0
                share.last_probe = now
            allowance = self.allowance(share, tenant, now)
            if share.in_flight.get(tenant, 0) >= allowance and self._asks_most(share, tenant, now):
                share.contended_until = now + window  # a tenant still asking for more than its share: contention
                raise Overloaded(model, tier, retry_floor_ms,
                                 f"tenant {tenant!r} is over its fair share ({allowance:.0f} requests in flight)")
        held = share.in_flight[tenant] = share.in_flight.get(tenant, 0) + 1
        share.peak[tenant] = (max(float(held), self._decayed(share.peak, tenant, now)), now)
        self._held[request_id] = (model, tenant)

    @staticmethod
    def _decayed(values: dict[str, tuple[float, float]], tenant: str, now: float) -> float:
        """A value that halves every HALF_LIFE_S: a tenant's recent peak in flight, or its recent request count."""
        value, when = values.get(tenant, (0.0, now))
        return value * 0.5 ** ((now - when) / HALF_LIFE_S)

    def _asks_most(self, share: _ModelShare, tenant: str, now: float) -> bool:
        """Only the tenant asking the most (recent requests per unit of weight) is held back: one asking within its
        share never is."""
        mine = self._decayed(share.asks, tenant, now) / self._weights.get(tenant, 1.0)
        return all(mine >= self._decayed(share.asks, t, now) / self._weights.get(t, 1.0)
                   for t in share.asks if t != tenant)

    def allowance(self, share: _ModelShare, tenant: str, now: float) -> float:
        active = {t for t, seen in share.last_seen.items() if now - seen <= ACTIVE_WINDOW_S or share.in_flight.get(t)}
        active.add(tenant)
        if len(active) == 1:
            return float("inf")  # alone: the admission policy alone decides
        total_weight = sum(self._weights.get(t, 1.0) for t in active)
        reserved = sum(1.25 * self._decayed(share.peak, other, now) + 2.0 for other in active - {tenant})
        return max(MIN_SHARE_FRACTION * share.capacity * self._weights.get(tenant, 1.0) / total_weight,
                   share.capacity - reserved)

    def on_shed(self, model: str) -> None:
        """The admission policy shed a request of `model`: learn the saturation point, mark contention."""
        if not self.enabled:
            return
        share = self._models.setdefault(model, _ModelShare())
        in_flight = sum(share.in_flight.values())
        if in_flight > 0:
            share.capacity = in_flight if share.capacity == 0 else (
                (1 - CAPACITY_EWMA) * share.capacity + CAPACITY_EWMA * in_flight)
        share.last_probe = self.clock()
        share.contended_until = share.last_probe + self.settings.contention_window_s

    def release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is None:
            return
        model, tenant = held
        share = self._models[model]
        left = share.in_flight.get(tenant, 0) - 1
        if left > 0:
            share.in_flight[tenant] = left
        else:
            share.in_flight.pop(tenant, None)

    def in_flight(self, model: str) -> dict[str, int]:
        return dict(self._models.get(model, _ModelShare()).in_flight)


def _key_from(metadata) -> str | None:
    for k, v in metadata or ():
        if k == "authorization" and isinstance(v, str) and v.lower().startswith("bearer "):
            return v[7:].strip()
        if k == "x-api-key" and isinstance(v, str):
            return v.strip()
    return None
