"""/metrics of the router: every replica's series labelled `replica="<index>"`, their aggregate
labelled `replica="all"`, and the router's own series (radixserve_router_*).

Aggregation: counters, histograms and additive gauges are summed over the live replicas; gauges
that are ratios (token usage, new-token ratio, acceptance length) are averaged; the cache hit rate
is recomputed from the summed prefill token counters (cached / (cached + computed)), so it is the
hit rate of all the prompt tokens the replicas processed, not a mean of rates. To sum by hand,
select `replica!="all"`."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

PREFIX = "radixserve_router"
_MEAN_MARKERS = ("ratio", "usage", "accept_length")
_HIT_RATE = "radixserve_scheduler_cache_hit_rate"
_CACHED = "radixserve_scheduler_prefill_tokens_cached"
_COMPUTED = "radixserve_scheduler_prefill_tokens_computed"


class RouterMetrics:
    """The router's own series."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routed_total = Counter(
            f"{PREFIX}_routed_requests", "Requests routed, by replica and reason", ["replica", "reason"], registry=r
        )
        self.up = Gauge(f"{PREFIX}_replica_up", "1 while the replica is in rotation", ["replica"], registry=r)
        self.in_flight = Gauge(
            f"{PREFIX}_replica_in_flight", "Requests the router has in flight on the replica", ["replica"], registry=r
        )

        # generation requests the router answered itself (API key, body size, shutting down): the replicas never
        # see them, so their requests_total misses them (operator audit 34)
        self.refused_total = Counter(
            f"{PREFIX}_refused_requests", "Generation requests the router refused itself, by route and HTTP status",
            ["route", "status"], registry=r,
        )

    def routed(self, replica: int, reason: str) -> None:
        self.routed_total.labels(str(replica), reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _line(name: str, labels: dict[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {floatToGoString(value)}"


def aggregate_replica_metrics(texts: dict[int, str]) -> str:
    """Prometheus text of the replicas' /metrics bodies (`texts`: replica index -> body), relabelled
    per replica and aggregated under replica="all"."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help), first seen wins
    lines: dict[str, list[str]] = defaultdict(list)
    sums: dict[str, dict[tuple[str, tuple], list[float]]] = defaultdict(lambda: defaultdict(list))
    for index, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            families.setdefault(fam.name, (fam.type, fam.documentation))
            for s in fam.samples:
                lines[fam.name].append(_line(s.name, {**s.labels, "replica": str(index)}, s.value))
                if not s.name.endswith("_created"):
                    sums[fam.name][(s.name, tuple(sorted(s.labels.items())))].append(s.value)
    totals = {
        name: sum(sum(v) for v in series.values()) for name, series in sums.items() if name in (_CACHED, _COMPUTED)
    }
    out: list[str] = []
    for name, (kind, doc) in families.items():
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(lines[name])
        for (sample, labels), values in sums[name].items():
            if name == _HIT_RATE and _CACHED in totals and _COMPUTED in totals:
                seen = totals[_CACHED] + totals[_COMPUTED]
                value = totals[_CACHED] / seen if seen else 0.0
            elif kind == "gauge" and any(m in name for m in _MEAN_MARKERS):
                value = sum(values) / len(values)
            else:
                value = sum(values)
            out.append(_line(sample, {**dict(labels), "replica": "all"}, value))
    return "\n".join(out) + ("\n" if out else "")


def aggregate_stats(stats: list[dict]) -> dict:
    """The replicas' scheduler stats (`get_stats` dicts) as one: numbers summed, ratios averaged,
    the cache hit rate recomputed from the prefill token counters."""
    out: dict = {}
    numeric = [s for s in stats if isinstance(s, dict)]
    keys = dict.fromkeys(k for s in numeric for k in s)
    for key in keys:
        values = [s[key] for s in numeric if isinstance(s.get(key), int | float) and not isinstance(s.get(key), bool)]
        if not values:
            continue
        if key == "time":
            out[key] = max(values)
        elif any(m in key for m in _MEAN_MARKERS):
            out[key] = sum(values) / len(values)
        else:
            out[key] = sum(values)
    cached, computed = out.get("prefill_tokens_cached"), out.get("prefill_tokens_computed")
    if cached is not None and computed is not None:
        out["cache_hit_rate"] = cached / (cached + computed) if cached + computed else 0.0
    return out
