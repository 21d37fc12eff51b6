"""Hostile requests against ``attnx serve`` (issues 32 and 45): one client's request must not stall or starve another's.

One ``attnx serve`` subprocess (HTTP and gRPC) serves the real all-MiniLM-L6-v2 and two tiny random Llama with-past
exports: ``llm``, whose chat template turns hostile on request (nested ``range(100000)`` loops), and ``benign``.
Throughout, a probe in this process opens a new connection for ``GET /v2/health/live`` every 20 ms with a 1 s
timeout, as a Kubernetes probe does. Each case sends its attack (one request or several at once) and, from 0.1 s
later, tiny well-formed neighbour requests (the kinds side by side), round after round while the attack lasts.
Cases (``--cases`` picks some; sizes in brackets are ``--quick``'s):

- the slow uploads: a declared 64 MiB ``Content-Length`` and a ``Transfer-Encoding: chunked`` body, one byte every
  0.5 s for 15 s [4 s], then 5 s more for an answer; two honest 33 MiB [8 MiB] uploads at once;
- guided JSON: a ``response_format`` schema of 10,000 [1,000] required properties, an ``enum`` of 100,000 [10,000]
  strings, ``{"type": "string", "pattern": "^x{1000000}$"}`` x4 [x{100000} x2] beside a greedy 48-token generation;
- counts: 100,000 [10,000] one-word prompts, 100,000 [10,000] and 1,000,000 [100,000] chat messages, 15 million
  [1 million] one-character strings and 2.7 million [200,000] token-id lists to ``/v1/embeddings``, 1,024 [128]
  texts of 20 KB to ``/v1/embeddings`` and to tei.v1 ``EmbedStream`` (gRPC), a tei.v1 ``Decode`` of 10^6 [10^5] ids;
- the looping template x8 [x2] beside a chat to the benign model;
- issue 32's: a 3 MB prompt and chat message, a 20 MB [2 MB] string, a 63 MiB [8 MiB] string with truncation off,
  the looping template once.

One row per case: the attacker's status, its message (one line, cut) and seconds from its last byte to its
answer; the probes' p50/p99/max, failed probes and the longest stretch without an answer; the neighbours' worst
latency and their statuses; the server's RSS before, peak (sampled every 0.1 s) and 1 s after; each against the
Bar of issue 45 (PASS/FAIL), then a summary. Every case is bounded (``--case-s``); a server that stays busy after
a case, grows past ``--rss-limit-mb`` (killed, as a container's OOM killer would) or dies is restarted for the next.

    .venv/bin/python benchmarks/bench_hostile_requests.py [--quick] [--cases slow-upload,pattern-x4] [--list]

Linux only (``/proc``). Needs nothing but the CPU. Before issue 32 the 3 MB prompt took 29 s with no probe
answered, the 20 MB string got no answer in 300 s and the looping template hung the server for good; the table
before issue 45 is in docs/performance.md ("Hostile requests").
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import hf_folders  # noqa: E402  (random-weight folders with a trained tokenizer, as the tests make them)
from _hostile import Answer, Probe, Server, exchange, grpc_call, tei_stubs  # noqa: E402

LOOPING = ("{%- if messages[-1]['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
           "{% endfor %}{% endfor %}{%- else %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
           "{% endfor %}<assistant>{%- endif %}")
BENIGN = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"

#: Issue 45's Bar, per column.
HEALTH_P99_MS, NEIGHBOUR_S, AFTER_LAST_BYTE_S, RSS_GROWTH_MB = 50.0, 0.5, 2.0, 256.0
CLIENT_ERRORS = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "NOT_FOUND"}

FULL = dict(trickle_s=15, honest_mib=33, props=10_000, enum=100_000, pattern=1_000_000, patterns=4, prompts=100_000,
            messages=100_000, messages_big=1_000_000, strings=15_000_000, id_lists=2_700_000, texts=1024,
            decode_ids=1_000_000, templates=8, string_mb=20, string_mib=63, case_s=45.0)
QUICK = dict(trickle_s=4, honest_mib=8, props=1_000, enum=10_000, pattern=100_000, patterns=2, prompts=10_000,
             messages=10_000, messages_big=100_000, strings=1_000_000, id_lists=200_000, texts=128,
             decode_ids=100_000, templates=2, string_mb=2, string_mib=8, case_s=20.0)


def models(root: Path) -> dict[str, Path]:
    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained import minilm_path

    folders = {}
    for name, template, seed in (("llm", LOOPING, 0), ("benign", BENIGN, 1)):
        folder = hf_folders.make_folder("llama", root / "folders" / name, seed=seed)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        folders[name] = folder
    return {"minilm": export_pretrained(minilm_path(), root / "minilm" / "minilm.onnx").path,
            **{name: export_pretrained(folder, root / name / "model.onnx", with_past=True).path
               for name, folder in folders.items()}}


# ----------------------------------------------------------------------------- requests


def js(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def guided(schema: dict, max_tokens: int = 8) -> bytes:
    return js({"model": "llm", "prompt": "answer in JSON", "max_tokens": max_tokens, "response_format": {
        "type": "json_schema", "json_schema": {"name": "hostile", "schema": schema}}})


def chat(model: str, messages: list[dict], max_tokens: int = 2) -> bytes:
    return js({"model": model, "messages": messages, "max_tokens": max_tokens})


NEIGHBOURS = {  # name: (path, body)
    "emb": ("/v1/embeddings", js({"model": "minilm", "input": "a tiny neighbour"})),
    "cmpl": ("/v1/completions", js({"model": "llm", "prompt": "hello there", "max_tokens": 2})),
    # the tiny Llama has 64 positions: 48 new tokens fit beside the prompt
    "greedy": ("/v1/completions", js({"model": "llm", "prompt": "hello there", "max_tokens": 48, "temperature": 0})),
    "chat2": ("/v1/chat/completions", chat("benign", [{"role": "user", "content": "hi"}])),
}

#: An attacker: ``fn(port, answer, deadline)`` fills ``answer``; ``size``: the bytes it sends (for the table).
Attacker = tuple[Callable[[int, Answer, float], None], int]


def post(path: str, body: bytes) -> Attacker:
    return (lambda port, answer, deadline: exchange(port, "POST", path, body, deadline=deadline, answer=answer),
            len(body))


def trickle(path: str, seconds: float, chunked: bool) -> Attacker:
    """A body declared 64 MiB (or chunked) whose bytes come one every 0.5 s for ``seconds``."""
    start = b'{"model":"minilm","input":"'
    if chunked:
        pieces = [(b"%x\r\n%s\r\n" % (len(start), start), 0.0)] + [(b"1\r\nx\r\n", 0.5)] * int(seconds / 0.5)
    else:
        pieces = [(start, 0.0)] + [(b"x", 0.5)] * int(seconds / 0.5)
    return (lambda port, answer, deadline: exchange(
        port, "POST", path, deadline=deadline, pieces=pieces, chunked=chunked,
        length=None if chunked else 64 << 20, answer_s=5.0, answer=answer), len(start) + int(seconds / 0.5))


def grpc_embed_stream(stubs, count: int, chars: int) -> Attacker:
    pb, rpc = stubs
    text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]

    def attack(port, answer, deadline):
        import grpc

        def requests():
            for _ in range(count):
                yield pb.EmbedRequest(inputs=text, truncate=True)
                answer.last_byte = time.perf_counter()

        with grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as ch:
            grpc_call(lambda t: rpc.EmbedStub(ch).EmbedStream(requests(), timeout=t, metadata=MODEL), deadline,
                      answer)

    return attack, count * chars


def grpc_decode(stubs, count: int) -> Attacker:
    pb, rpc = stubs
    request = pb.DecodeRequest(ids=[1000 + i % 1000 for i in range(count)])

    def attack(port, answer, deadline):
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as ch:
            grpc_call(lambda t: rpc.TokenizeStub(ch).Decode(request, timeout=t, metadata=MODEL), deadline, answer)

    return attack, request.ByteSize()


OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
MODEL = [("model", "minilm")]


@dataclass
class Case:
    label: str
    attackers: Callable[[], list[Attacker]]  # built before the case's clock starts
    neighbours: tuple[str, ...] = ("emb", "cmpl")
    grpc: bool = False  # the attack goes to the gRPC port
    attacker_s: float = AFTER_LAST_BYTE_S  # the looping template is refused at its render limit, 2 s: allow 3


def cases(z: dict, stubs) -> dict[str, Case]:
    three_mb = "the cat sat on the mat " * 140_000
    loop = [{"role": "user", "content": "loop"}]
    props = {f"p{i}": {"type": "string"} for i in range(z["props"])}
    return {
        "prompt-3mb": Case("3 MB prompt, /v1/completions", lambda: [post("/v1/completions", js(
            {"model": "llm", "prompt": three_mb}))]),
        "chat-3mb": Case("3 MB message, /v1/chat/completions", lambda: [post("/v1/chat/completions", chat(
            "llm", [{"role": "user", "content": three_mb}]))]),
        "string-20mb": Case(f"{z['string_mb']} MB string, /v1/embeddings", lambda: [post("/v1/embeddings", js(
            {"model": "minilm", "input": "word " * (z["string_mb"] * 200_000)}))]),
        "string-63mib": Case(f"{z['string_mib']} MiB string, truncate off", lambda: [post("/v1/embeddings", js(
            {"model": "minilm", "input": "x" * (z["string_mib"] << 20), "truncate": False}))]),
        "template-loop": Case("looping chat template", lambda: [post("/v1/chat/completions", chat("llm", loop))],
                              attacker_s=3.0),
        "slow-upload": Case(f"64 MiB declared, 1 B/0.5 s for {z['trickle_s']} s",
                            lambda: [trickle("/v1/embeddings", z["trickle_s"], chunked=False)]),
        "chunked-trickle": Case(f"chunked, 1 B/0.5 s for {z['trickle_s']} s",
                                lambda: [trickle("/v1/embeddings", z["trickle_s"], chunked=True)]),
        "two-33mib": Case(f"2 x {z['honest_mib']} MiB honest uploads", lambda: [post("/v1/embeddings", js(
            {"model": "minilm", "input": "word " * ((z["honest_mib"] << 20) // 5)}))] * 2, ("emb",)),
        "schema-props": Case(f"schema, {z['props']:,} required properties", lambda: [post("/v1/completions", guided(
            {"type": "object", "properties": props, "required": list(props)}))]),
        "schema-enum": Case(f"schema, enum of {z['enum']:,} strings", lambda: [post("/v1/completions", guided(
            {"type": "string", "enum": [f"value{i}" for i in range(z["enum"])]}))]),
        "pattern-x4": Case(f"pattern ^x{{{z['pattern']}}}$ x{z['patterns']}", lambda: [post(
            "/v1/completions", guided({"type": "string", "pattern": f"^x{{{z['pattern']}}}$"}))] * z["patterns"],
                           ("greedy",)),
        "prompts": Case(f"{z['prompts']:,} one-word prompts", lambda: [post("/v1/completions", js(
            {"model": "llm", "prompt": ["word"] * z["prompts"], "max_tokens": 1}))]),
        "messages": Case(f"{z['messages']:,} chat messages", lambda: [post("/v1/chat/completions", chat(
            "llm", [{"role": "user", "content": "hello"}] * z["messages"]))]),
        "messages-big": Case(f"{z['messages_big']:,} chat messages", lambda: [post("/v1/chat/completions", chat(
            "llm", [{"role": "user", "content": "hello"}] * z["messages_big"]))]),
        "strings": Case(f"{z['strings']:,} 1-char strings, /v1/embeddings", lambda: [post("/v1/embeddings", js(
            {"model": "minilm", "input": ["a"] * z["strings"]}))]),
        "id-lists": Case(f"{z['id_lists']:,} token-id lists, /v1/embeddings", lambda: [post("/v1/embeddings", js(
            {"model": "minilm", "input": [[1012, 2023, 1029, 102]] * z["id_lists"]}))]),
        "texts": Case(f"{z['texts']:,} texts of 20 KB, /v1/embeddings", lambda: [post("/v1/embeddings", js(
            {"model": "minilm", "input": [("lorem ipsum dolor sit amet " * 760)[:20_000]] * z["texts"]}))]),
        "grpc-texts": Case(f"{z['texts']:,} texts of 20 KB, tei EmbedStream",
                           lambda: [grpc_embed_stream(stubs, z["texts"], 20_000)], ("emb",), grpc=True),
        "grpc-decode": Case(f"tei Decode of {z['decode_ids']:,} ids", lambda: [grpc_decode(stubs, z["decode_ids"])],
                            ("emb",), grpc=True),
        "templates": Case(f"looping template x{z['templates']}", lambda: [post(
            "/v1/chat/completions", chat("llm", loop))] * z["templates"], ("chat2",), attacker_s=3.0),
    }


# ----------------------------------------------------------------------------- running a case


def neighbour_rounds(port: int, kinds: tuple[str, ...], attacks: list[threading.Thread], deadline: float,
                     out: list[tuple[str, Answer]]) -> None:
    """Each kind once a round, the kinds side by side, while the attack lasts: rounds 0.3 s apart, then (from
    the 10th) 1 s apart, so that a long attack is sampled to its end (at least one round, at most 60)."""
    for number in range(60):
        round_ = [(kind, Answer()) for kind in kinds]
        threads = [threading.Thread(target=exchange, args=(port, "POST", *NEIGHBOURS[kind]), daemon=True,
                                    kwargs=dict(deadline=max(deadline, time.perf_counter() + 5), answer=answer))
                   for kind, answer in round_]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.perf_counter()) + 10)
        out.extend(round_)
        if not any(a.is_alive() for a in attacks) or time.perf_counter() > deadline:
            return
        time.sleep(0.3 if number < 10 else 1.0)


def run_case(case: Case, server: Server, probe: Probe, case_s: float) -> dict:
    attackers = case.attackers()
    size = sum(s for _, s in attackers)
    load = Path("/proc/loadavg").read_text().split()[0]
    before = server.rss_mb()
    server.reset_peak()
    answers = [Answer() for _ in attackers]
    start = time.perf_counter()
    deadline = start + case_s
    port = server.grpc_port if case.grpc else server.port
    threads = [threading.Thread(target=fn, args=(port, answer, deadline), daemon=True)
               for (fn, _), answer in zip(attackers, answers)]
    for t in threads:
        t.start()
    time.sleep(0.1)  # the attack's head is out: neighbours go while its body is sent and while it is worked on
    neighbours: list[tuple[str, Answer]] = []
    neighbour_rounds(server.port, case.neighbours, threads, deadline, neighbours)
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()) + 10)
    end = time.perf_counter()
    probes, failed, gap = probe.during(start, end)
    peak = server.peak
    time.sleep(1.0)
    return dict(size=size, load=load, answers=answers, neighbours=neighbours, probes=probes, failed=failed, gap=gap,
                attacker_s=case.attacker_s, before=before, peak=peak, after=server.rss_mb(),
                killed=server.killed_for_rss)


# ----------------------------------------------------------------------------- the table


def attacker_ok(a: Answer, within_s: float) -> bool:
    """A one-line client error, or an answer, within ``within_s`` of its last byte (never a 5xx, never none)."""
    status_ok = a.status in CLIENT_ERRORS or a.status == "OK" or (a.status.isdigit() and a.status[0] in "24")
    return status_ok and a.after_last_byte is not None and a.after_last_byte <= within_s \
        and "\\n" not in a.message


def counted(statuses: list[str]) -> str:
    return ",".join(f"{s}x{statuses.count(s)}" if statuses.count(s) > 1 else s for s in dict.fromkeys(statuses))


def verdicts(r: dict) -> dict[str, bool]:
    growth = max(r["peak"], r["after"]) - r["before"]
    probes = r["probes"]
    return {"attacker": all(attacker_ok(a, r["attacker_s"]) for a in r["answers"]),
            "health": bool(probes.size) and float(np.percentile(probes, 99)) < HEALTH_P99_MS,
            "probes": r["failed"] == 0,
            "neighbour": bool(r["neighbours"]) and all(a.status == "200" and a.latency < NEIGHBOUR_S
                                                      for _, a in r["neighbours"]),
            "rss": not r["killed"] and growth < RSS_GROWTH_MB}


HEADER = (f"{'case':40} {'MB':>6} {'load':>5} | {'attacker':>9} {'s after':>7} {'message':50} | {'p50':>6} "
          f"{'p99':>6} {'max':>6} {'fail':>4} {'gap s':>6} | {'nbr s':>6} {'nbr status':>16} | "
          f"{'RSS before':>10} {'peak':>6} {'after':>6} {'growth':>6} | verdict")


def row(name: str, r: dict) -> str:
    answers, probes = r["answers"], r["probes"]
    times = [a.after_last_byte for a in answers]
    after = "-" if not answers else "none" if None in times else f"{max(times):.2f}"
    message = next((a.message for a in answers if a.status not in ("200", "OK")), answers[0].message if answers
                   else "")
    if r["killed"]:
        message = "server killed: RSS over the limit. " + message
    p50, p99, top = (np.percentile(probes, 50), np.percentile(probes, 99), probes.max()) if probes.size \
        else (float("nan"),) * 3
    nbr = max((a.latency for _, a in r["neighbours"]), default=float("nan"))
    growth = max(r["peak"], r["after"]) - r["before"]
    v = verdicts(r) if answers else {}
    verdict = " ".join(f"{k}:{'PASS' if ok else 'FAIL'}" for k, ok in v.items())
    return (f"{name[:40]:40} {r['size'] / 1e6:6.1f} {r['load']:>5} | {counted([a.status for a in answers]):>9.9} "
            f"{after:>7} {message[:50]:50} | {p50:6.1f} {p99:6.1f} {top:6.0f} {r['failed']:4d} {r['gap']:6.2f} | "
            f"{nbr:6.2f} {counted([a.status for _, a in r['neighbours']]):>16.16} | {r['before']:10.0f} "
            f"{r['peak']:6.0f} {r['after']:6.0f} {growth:+6.0f} | {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller attacks (a smoke run)")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all; --list shows them)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--case-s", type=float, help="bound on each case in seconds (default 45, --quick 20)")
    parser.add_argument("--settle-s", type=float, default=15.0, help="wait this long for an idle server after a "
                        "case before restarting it")
    parser.add_argument("--rss-limit-mb", type=float, default=3000.0, help="kill the server past this RSS")
    parser.add_argument("--idle-s", type=float, default=3.0)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    case_s = args.case_s or sizes["case_s"]
    root = Path(tempfile.mkdtemp(prefix="attnx-hostile-"))
    try:
        table = cases(sizes, tei_stubs(root / "stubs"))
        if args.list:
            print("\n".join(f"{k:16} {c.label}" for k, c in table.items()))
            return
        picked = [c.strip() for c in args.cases.split(",") if c.strip()] or list(table)
        unknown = sorted(set(picked) - set(table))
        if unknown:
            raise SystemExit(f"unknown cases {unknown}; known: {', '.join(table)}")
        server = Server(models(root), root / "server.log", args.rss_limit_mb)
        server.start()
        import attnx

        print(f"server: {' '.join(server.argv[:4])} ... in {Path(f'/proc/{server.proc.pid}/cwd').resolve()} "
              f"(attnx from {Path(attnx.__file__).parent}); "
              f"load average at start: {Path('/proc/loadavg').read_text().strip()}")
        print(f"Bar: health p99 < {HEALTH_P99_MS:.0f} ms, no failed probe (1 s timeout), every neighbour 200 in "
              f"< {NEIGHBOUR_S} s, attacker a one-line 4xx (or an answer) within {AFTER_LAST_BYTE_S:.0f} s of its "
              f"last byte, RSS growth (peak or after, minus before) < {RSS_GROWTH_MB:.0f} MB; each case bounded at "
              f"{case_s:.0f} s{' (--quick sizes)' if args.quick else ''}", flush=True)
        probe = Probe(server)
        probe.start()
        try:
            start = time.perf_counter()
            time.sleep(args.idle_s)
            idle = server.rss_mb()
            probes, failed, gap = probe.during(start, time.perf_counter())
            alone = {}
            for kind in NEIGHBOURS:  # each neighbour on the idle server: what "tiny" costs here
                answer = exchange(server.port, "POST", *NEIGHBOURS[kind], deadline=time.perf_counter() + 30)
                alone[kind] = f"{kind} {answer.status} {answer.latency:.2f} s" + (
                    f" ({answer.message[:80]})" if answer.status != "200" else "")
            print(f"neighbours alone: {', '.join(alone.values())}\n\n{HEADER}")
            results = {"idle": dict(size=0, load=Path("/proc/loadavg").read_text().split()[0], answers=[],
                                    neighbours=[], probes=probes, failed=failed, gap=gap, before=idle, peak=idle,
                                    after=idle, killed=False)}
            print(row("idle", results["idle"]), flush=True)
            for name in picked:
                case = table[name]
                results[name] = r = run_case(case, server, probe, case_s)
                print(row(f"{name}: {case.label}", r), flush=True)
                if not server.alive() or not server.settled(args.settle_s) or server.rss_mb() > idle + 512:
                    why = "killed for RSS" if server.killed_for_rss else "busy or grown" if server.alive() else "dead"
                    print(f"  (restarting the server: {why})", flush=True)
                    server.stop()
                    server.start()
        finally:
            probe.stop.set()
            server.stop()
        print(f"\nload average at the end: {Path('/proc/loadavg').read_text().strip()}; server restarts: "
              f"{server.restarts}")
        passed = [n for n, r in results.items() if r["answers"] and all(verdicts(r).values())]
        print(f"summary: {len(passed)} of {len(results) - 1} cases meet the whole Bar")
        for name, r in results.items():
            if r["answers"]:
                failing = [k for k, ok in verdicts(r).items() if not ok]
                print(f"  {name:16} {'PASS' if not failing else 'FAIL: ' + ', '.join(failing)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
