"""Prometheus text exposition: the compact form heartbeats carry, and the merge of several into one.

Pure functions over text (no registry of their own); `libs.runtime.metrics` builds on them. The
merge sums samples with equal name and labels, restores histogram buckets a compact text left out
(bucket counts are cumulative, so a missing bucket equals the one below it), and renders valid
text format 0.0.4 with HELP/TYPE. TGI's counters keep their bare names (no `_total`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

# TGI's counters are exported without the `_total` suffix
BARE_COUNTERS = frozenset(
    {
        "tgi_request_count",
        "tgi_request_success",
        "tgi_request_failure",
        "tgi_batch_inference_count",
        "tgi_batch_inference_success",
        "tgi_batch_inference_failure",
        "tgi_batch_concat",
    }
)

# families that describe one process: never carried on once that process is gone
PER_PROCESS_PREFIX = "switchyard_process_"


def compact(fam) -> Family:
    f = Family(fam.type)
    by_labels: dict[tuple, list] = {}
    for s in fam.samples:
        if not s.name.endswith("_created"):
            by_labels.setdefault(key_of({k: v for k, v in s.labels.items() if k != "le"}), []).append(s)
    for key, samples in by_labels.items():
        if not key and _untouched(fam.type, samples):
            continue
        prev = 0.0
        for s in samples:
            if s.name.endswith("_bucket"):
                if s.value == prev and s.labels["le"] != "+Inf":
                    continue  # cumulative: equal to the bucket below, restored by merge
                prev = s.value
            f.samples[(s.name, key_of(s.labels))] = s.value
    return f


def _untouched(kind: str, samples) -> bool:
    if kind in ("histogram", "summary"):
        return all(s.value == 0 for s in samples if s.name.endswith("_count"))
    return all(s.value == 0 for s in samples)


@dataclass
class Family:
    type: str
    samples: dict[tuple[str, tuple], float] = field(default_factory=dict)


def key_of(labels: dict) -> tuple:
    return tuple(sorted(labels.items()))


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(key: tuple) -> str:
    if not key:
        return ""
    items = sorted(key, key=lambda kv: (kv[0] == "le", kv[0]))  # `le` last, as is customary
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in items) + "}"


def render(families: dict[str, Family], helps: dict[str, str]) -> str:
    lines = []
    for name, f in families.items():
        if not f.samples:
            continue
        # a counter's header names its samples (x_total), as prometheus_client's own text does
        head = name + "_total" if f.type == "counter" and name not in BARE_COUNTERS else name
        if name in helps:
            lines.append(f"# HELP {head} {helps[name].replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}")
        lines.append(f"# TYPE {head} {f.type}")
        for (sname, key), value in f.samples.items():
            if f.type == "counter" and name in BARE_COUNTERS and sname == name + "_total":
                sname = name
            lines.append(f"{sname}{_fmt_labels(key)} {floatToGoString(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def merge(texts: Iterable[str], definitions=None) -> str:
    """One Prometheus text from several processes' texts: samples with the same name and labels are
    summed (counters, histogram buckets/_sum/_count, summaries, and gauges too: queue size over
    replicas); distinct labels stay apart. Histogram buckets left out by a compact text are restored
    from the buckets around them. `definitions` (a metrics.Metrics) adds HELP lines,
    the full bucket layouts and zeros for unlabelled metrics no process recorded."""
    defs = definitions
    parsed = [families(text) for text in texts if text]
    out: dict[str, Family] = {}
    helps: dict[str, str] = {}
    if defs is not None:  # every known family first, in definition order, zero where unlabelled
        for name, (kind, doc) in defs.definitions.items():
            helps[name] = doc
            out[name] = Family(kind)
        for fam in defs.registry.collect():
            for s in fam.samples:
                if not s.labels.keys() - {"le"} and not s.name.endswith("_created"):
                    out[fam.name].samples[(s.name, key_of(s.labels))] = 0.0
    for fams in parsed:
        for name, fam in fams.items():
            f = out.setdefault(name, Family(fam.type))
            if fam.documentation and name not in helps:
                helps[name] = fam.documentation
            if fam.type != "histogram":
                for s in fam.samples:
                    if not s.name.endswith("_created"):
                        k = (s.name, key_of(s.labels))
                        f.samples[k] = f.samples.get(k, 0.0) + s.value
    # histograms: every text's buckets expanded to the union layout (cumulative: carry forward), then summed
    for name, f in out.items():
        if f.type != "histogram":
            continue
        layout = set(defs.layouts.get(name, ())) if defs is not None else set()
        for fams in parsed:
            if name in fams:
                layout.update(float(s.labels["le"]) for s in fams[name].samples if s.name.endswith("_bucket"))
        layout.add(math.inf)
        series: dict[tuple, dict[float, float]] = {}  # labels without le → le → summed cumulative count
        rest: dict[tuple[str, tuple], float] = {}
        for (sname, key), v in f.samples.items():  # zeros from the definitions
            if sname.endswith("_bucket"):
                series.setdefault(tuple(kv for kv in key if kv[0] != "le"), {})
            else:
                rest[(sname, key)] = v
        for fams in parsed:
            if name not in fams:
                continue
            buckets: dict[tuple, dict[float, float]] = {}
            for s in fams[name].samples:
                if s.name.endswith("_bucket"):
                    key = key_of({k: v for k, v in s.labels.items() if k != "le"})
                    buckets.setdefault(key, {})[float(s.labels["le"])] = s.value
                elif not s.name.endswith("_created"):
                    k = (s.name, key_of(s.labels))
                    rest[k] = rest.get(k, 0.0) + s.value
            for key, got in buckets.items():
                acc = series.setdefault(key, {})
                carried = 0.0
                for le in sorted(layout):
                    carried = got.get(le, carried)
                    acc[le] = acc.get(le, 0.0) + carried
        f.samples = {}
        for key, acc in series.items():
            for le in sorted(layout):
                f.samples[(name + "_bucket", key + (("le", floatToGoString(le)),))] = acc.get(le, 0.0)
            for suffix in ("_sum", "_count"):
                f.samples[(name + suffix, key)] = rest.get((name + suffix, key), 0.0)
    return render(out, helps)


@functools.lru_cache(maxsize=64)
def families(text: str) -> dict:
    """A text's metric families by name, parsed once: a process's last heartbeat text is merged again at every
    scrape until its next heartbeat, and parsing is most of a merge's cost. The result is shared: read it only."""
    return {fam.name: fam for fam in text_string_to_metric_families(text)}


class _NoDefinitions:
    definitions: dict = {}
    layouts: dict = {}

    class registry:  # noqa: N801 - quacks like a CollectorRegistry with nothing in it
        @staticmethod
        def collect():
            return ()


NO_DEFINITIONS = _NoDefinitions()


def counters_only(text: str) -> str:
    """The monotonic families of a text (counters, histograms, summaries), minus per-process ones."""
    keep = []
    for fam in text_string_to_metric_families(text) if text else ():
        if fam.type in ("counter", "histogram", "summary") and not fam.name.startswith(PER_PROCESS_PREFIX):
            f = Family(fam.type, {(s.name, key_of(s.labels)): s.value for s in fam.samples})
            keep.append((fam.name, f))
    return render(dict(keep), {})
