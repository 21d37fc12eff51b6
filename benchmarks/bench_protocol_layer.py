"""attnx's own KServe v2 protocol layer vs KServe's Python model server in front of the same batcher (issue 12, item 2).

The real all-MiniLM-L6-v2 (exported by attnx, or ``--model``) served two ways, each in its own
subprocess on a loopback port, with the same ONNX Runtime threads (``--threads``, default 1):

- ``attnx``: ``attnx serve MODEL --max-batch 1`` (attnx's FastAPI/uvicorn layer, runtime/server.py);
- ``kserve``: a ``kserve.Model`` whose async ``predict`` hands the decoded tensors to the same
  :class:`~attnx.runtime.core.batcher.DynamicBatcher` over the same attnx Session (``kserve.ModelServer``,
  one worker, its gRPC server beside it) — i.e. kserve as the protocol layer under attnx's batcher.

Batching is off in both (max batch 1; 8 for the 8x128 requests, so each batch is still exactly one
request), so only the protocol layer differs. From this process the unmodified ``tritonclient.http``
sends token-id requests (1x16, 1x128, 8x128; JSON tensors, and the binary tensor extension where the
server takes it): one sequential client (p50/p99: the protocol overhead is the latency difference) and
``--concurrency`` clients (throughput), servers interleaved round by round. Every answer is checked
against ``session.run`` alone (max abs diff) and errors are counted. Then the behaviour differences
are probed and printed: binary extension, BYTES text, errors for a wrong shape and a wrong dtype,
metadata, health, metrics, gRPC.

    .venv/bin/python benchmarks/bench_protocol_layer.py [--model M.onnx] [--threads 1] [--rounds 3] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

MODEL_NAME = "minilm"
#: (label, batch, seq, server max batch): 8-row requests need a max batch of 8 (one request per batch).
SHAPES = [("1x16", 1, 16, 1), ("1x128", 1, 128, 1), ("8x128", 8, 128, 8)]
TOLERANCE = 1e-4


# ----------------------------------------------------------------------------- the kserve server


def kserve_server_main(argv: list[str]) -> None:
    """Runs in the kserve subprocess: a kserve.Model over attnx's batcher, served by kserve.ModelServer."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--verbose-logs", action="store_true", help="kserve's default INFO logs and access log")
    args = ap.parse_args(argv)
    # kserve.model_server parses sys.argv when imported (parse_known_args; "--model" would abbreviate
    # its --model_name): give it nothing. KSERVE_LOGLEVEL is read at import time too.
    sys.argv = sys.argv[:1]
    if not args.verbose_logs:
        os.environ.setdefault("KSERVE_LOGLEVEL", "WARNING")
    import logging

    import kserve
    from kserve.errors import InvalidInput
    from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
    from kserve.utils.numpy_codec import from_np_dtype

    from attnx.runtime import BatcherConfig, DynamicBatcher, InputError, load
    from attnx.runtime.serving.signature import triton_dtype
    from attnx.runtime.core.text import TextTokenizer, decode_text, stack_rows, text_feeds

    class AttnxModel(kserve.Model):
        def __init__(self, name: str, path: str):
            super().__init__(name)
            self.session = load(path, device="cpu", threads=args.threads)
            self.tokenizer = TextTokenizer.from_export(self.session.path, self.session.info)
            # The same settings `attnx serve --max-batch N` uses (its CLI defaults otherwise).
            config = BatcherConfig(max_batch_size=args.max_batch, max_queue_delay_ms=2.0, max_queue_size=1024,
                                   timeout_ms=30_000.0, max_length_ratio=1.5)
            self.batcher = DynamicBatcher(self.session, config, name=name,
                                          pad_id=self.tokenizer.pad_id if self.tokenizer else None)
            self.ready = True

        def _types(self, specs):
            return [{"name": s.name, "datatype": triton_dtype(s.dtype),
                     "shape": [d if isinstance(d, int) else -1 for d in s.shape]} for s in specs]

        def get_input_types(self):
            return self._types(self.session.inputs)

        def get_output_types(self):
            return self._types(self.session.outputs)

        async def predict(self, payload: InferRequest, headers=None) -> InferResponse:
            wanted = [o.name for o in payload.request_outputs] if payload.request_outputs else None
            try:
                feeds = {i.name: i.as_numpy() for i in payload.inputs}
                if "text" in feeds and self.tokenizer is not None:  # what attnx does with a BYTES text input
                    texts = [decode_text(v, k) for k, v in enumerate(np.asarray(feeds.pop("text")).ravel())]
                    parts = [await self.batcher.infer_async(text_feeds(self.session.inputs, e), output_names=wanted)
                             for e in self.tokenizer.tokenize(texts)]
                    outputs = stack_rows(parts, self.session.outputs)
                else:
                    outputs = await self.batcher.infer_async(feeds, output_names=wanted)
            except (InputError, ValueError) as e:
                raise InvalidInput(str(e)) from None
            # Raw bytes when the request wants binary outputs (gRPC with raw inputs, or REST asking for
            # binary), else JSON lists, as kserve.utils.utils.get_predict_response does. (data=array,
            # which to_rest takes, makes to_grpc fail for a request with raw inputs.)
            asked = payload.request_outputs or []
            binary = payload.use_binary_outputs or bool(asked) and all(o.binary_data for o in asked)
            infer_outputs = []
            for n, a in outputs.items():
                out = InferOutput(name=n, shape=list(a.shape), datatype=from_np_dtype(a.dtype))
                out.set_data_from_numpy(a, binary_data=binary)
                infer_outputs.append(out)
            return InferResponse(response_id=payload.id or "", model_name=self.name, infer_outputs=infer_outputs,
                                 use_binary_outputs=payload.use_binary_outputs,
                                 requested_outputs=payload.request_outputs)

    model = AttnxModel(MODEL_NAME, args.model)
    server = kserve.ModelServer(http_port=args.http_port, grpc_port=args.grpc_port, workers=1,
                                enable_latency_logging=args.verbose_logs)
    if not args.verbose_logs:  # attnx serve runs with access_log=False, log level warning
        logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    server.start([model])


# ----------------------------------------------------------------------------- starting servers


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), all its threads: less swayed by a busy machine than
    wall-clock latency, and the same model compute in both servers, so the difference is the protocol layer."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """A server subprocess; its stderr goes to a file (never a pipe nobody reads)."""

    def __init__(self, kind: str, cmd: list[str], log: Path, http: str | None = None, grpc: str | None = None):
        self.kind, self.cmd, self.log = kind, cmd, log
        self.http, self.grpc = http, grpc
        self._log_file = open(log, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0) -> "ServerProc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            if self.http is None:  # attnx serve --port 0 prints its address
                text = self.log.read_text(errors="replace")
                for line in text.splitlines():
                    if line.startswith("listening on http://"):
                        self.http = line.split("http://", 1)[1].strip()
                    elif line.startswith("gRPC listening on "):
                        self.grpc = line.split("on ", 1)[1].strip()
            if self.http is not None:
                try:
                    status, _, _ = raw_request(self.http, "GET", f"/v2/models/{MODEL_NAME}/ready", timeout=2)
                    if status == 200:
                        return self
                except OSError:
                    pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.kind} server not ready in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def start_attnx(model: Path, threads: int, max_batch: int, log: Path) -> ServerProc:
    exe = Path(sys.executable).with_name("attnx")
    cmd = [str(exe), "serve", str(model), "--port", "0", "--grpc-port", "0", "--max-batch", str(max_batch),
           "--threads", str(threads), "--device", "cpu"]
    return ServerProc("attnx", cmd, log)


def start_kserve(model: Path, threads: int, max_batch: int, log: Path, verbose_logs: bool) -> ServerProc:
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_kserve-server", str(model),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--threads", str(threads),
           "--max-batch", str(max_batch)] + (["--verbose-logs"] if verbose_logs else [])
    return ServerProc("kserve", cmd, log, http=f"127.0.0.1:{http_port}", grpc=f"127.0.0.1:{grpc_port}")


# ----------------------------------------------------------------------------- clients


def raw_request(address: str, method: str, path: str, body: bytes | None = None, headers=None, timeout=30.0):
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def token_feeds(batch: int, seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """BERT-like token ids: [CLS] words [SEP], full mask, type ids 0."""
    ids = rng.integers(1996, 29000, size=(batch, seq), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


class Checker:
    """Compares each answer with session.run alone; keeps the worst difference."""

    def __init__(self, references: list[np.ndarray]):
        self.references = references
        self.max_diff = 0.0
        self._lock = threading.Lock()

    def __call__(self, index: int, answer) -> bool:
        got = answer.get("sentence_embedding")
        ref = self.references[index]
        if got is None or got.shape != ref.shape:
            return False
        diff = float(np.max(np.abs(got - ref)))
        with self._lock:
            self.max_diff = max(self.max_diff, diff)
        return diff <= TOLERANCE


def http_factory(address: str, encoding: str, headers: dict | None, timeout_s: float = 120.0, **infer_kwargs):
    """One tritonclient.http client per thread; JSON or binary tensors in and out; asks for sentence_embedding."""

    def factory():
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(address, connection_timeout=timeout_s, network_timeout=timeout_s)
        binary = encoding == "binary"
        outputs = [httpclient.InferRequestedOutput("sentence_embedding", binary_data=binary)]

        class Call:
            def __call__(self, feeds):
                inputs = []
                for name, arr in feeds.items():
                    i = httpclient.InferInput(name, list(arr.shape), "INT64")
                    i.set_data_from_numpy(arr, binary_data=binary)
                    inputs.append(i)
                result = client.infer(MODEL_NAME, inputs, outputs=outputs, headers=headers, **infer_kwargs)
                return {"sentence_embedding": result.as_numpy("sentence_embedding")}

            def close(self):
                client.close()

        return Call()

    return factory


def one_infer(address: str, encoding: str, feeds, headers=None, **infer_kwargs):
    call = http_factory(address, encoding, headers, **infer_kwargs)()
    try:
        return call(feeds)
    finally:
        call.close()


def short(e: BaseException | str, n: int = 160) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= n else text[: n - 3] + "..."


# ----------------------------------------------------------------------------- behaviour probes


#: Per encoding: the Content-Type a server may need beyond what tritonclient sends (it sends none).
CONTENT_TYPES = {"json": "application/json", "binary": "application/octet-stream"}


def probe_encodings(servers: dict, feeds, ref) -> dict:
    """JSON and binary tensors from the unmodified client as it is, and with a Content-Type header added."""
    out = {}
    for kind, srv in servers.items():
        row = {}
        for enc, ctype in CONTENT_TYPES.items():
            for label, headers in [("no Content-Type (tritonclient default)", None), (ctype, {"Content-Type": ctype})]:
                try:
                    got = one_infer(srv.http, enc, feeds, headers)["sentence_embedding"]
                    row[f"{enc}, {label}"] = f"ok (max diff {np.max(np.abs(got - ref)):.1e})"
                except Exception as e:  # noqa: BLE001 - recorded
                    row[f"{enc}, {label}"] = f"FAILS: {short(e)}"
        try:  # tritonclient's request_compression_algorithm: Content-Encoding gzip
            got = one_infer(srv.http, "binary", feeds, None, request_compression_algorithm="gzip")["sentence_embedding"]
            row["binary, gzip request body"] = f"ok (max diff {np.max(np.abs(got - ref)):.1e})"
        except Exception as e:  # noqa: BLE001 - recorded
            row["binary, gzip request body"] = f"FAILS: {short(e)}"
        out[kind] = row
    return out


def headers_for(probe: dict, enc: str):
    """None if kserve takes the encoding as tritonclient sends it, the Content-Type header it needs, or False."""
    row = probe["kserve"]
    if row[f"{enc}, no Content-Type (tritonclient default)"].startswith("ok"):
        return None
    ctype = CONTENT_TYPES[enc]
    return {"Content-Type": ctype} if row[f"{enc}, {ctype}"].startswith("ok") else False


def probe_errors(servers: dict) -> dict:
    """Raw HTTP status and body for a wrong-shape and a wrong-dtype request, and an unknown model."""
    ids = [101] + [2000 + i for i in range(14)] + [102]
    good = lambda name, data: {"name": name, "shape": [1, 16], "datatype": "INT64", "data": data}  # noqa: E731
    cases = {
        "wrong shape (input_ids [16], rank 1)": {"inputs": [
            {"name": "input_ids", "shape": [16], "datatype": "INT64", "data": ids},
            good("attention_mask", [1] * 16), good("token_type_ids", [0] * 16)]},
        "wrong dtype (input_ids FP32)": {"inputs": [
            {"name": "input_ids", "shape": [1, 16], "datatype": "FP32", "data": [float(v) for v in ids]},
            good("attention_mask", [1] * 16), good("token_type_ids", [0] * 16)]},
        "shape/data mismatch ([1,16], 8 values)": {"inputs": [
            {"name": "input_ids", "shape": [1, 16], "datatype": "INT64", "data": ids[:8]},
            good("attention_mask", [1] * 16), good("token_type_ids", [0] * 16)]},
        "missing input (no token_type_ids)": {"inputs": [good("input_ids", ids), good("attention_mask", [1] * 16)]},
    }
    out = {}
    for kind, srv in servers.items():
        row = {}
        for label, body in cases.items():
            status, _, data = raw_request(srv.http, "POST", f"/v2/models/{MODEL_NAME}/infer", json.dumps(body).encode(),
                                          {"Content-Type": "application/json"})
            row[label] = f"{status} {short(data.decode(errors='replace'), 150)}"
        status, _, data = raw_request(srv.http, "POST", f"/v2/models/{MODEL_NAME}/infer", b'{"inputs": [',
                                      {"Content-Type": "application/json"})
        row["malformed JSON"] = f"{status} {short(data.decode(errors='replace'), 150)}"
        status, _, data = raw_request(srv.http, "POST", "/v2/models/nope/infer", json.dumps(cases[
            "missing input (no token_type_ids)"]).encode(), {"Content-Type": "application/json"})
        row["unknown model"] = f"{status} {short(data.decode(errors='replace'), 150)}"
        out[kind] = row
    return out


def probe_text(servers: dict) -> dict:
    """A BYTES 'text' input, JSON and binary, against attnx's answer for the same text."""
    import tritonclient.http as httpclient

    texts = np.array([b"The quick brown fox jumps over the lazy dog.", b"Protocol layers, measured."], dtype=object)
    answers, out = {}, {}
    for kind, srv in servers.items():
        row = {}
        for enc, headers in (("json", None), ("json + Content-Type", {"Content-Type": "application/json"}),
                             ("binary", None)):
            client = httpclient.InferenceServerClient(srv.http, network_timeout=60)
            try:
                i = httpclient.InferInput("text", [len(texts)], "BYTES")
                i.set_data_from_numpy(texts, binary_data=enc == "binary")
                r = client.infer(MODEL_NAME, [i], headers=headers, outputs=[
                    httpclient.InferRequestedOutput("sentence_embedding", binary_data=enc == "binary")])
                answers[(kind, enc)] = r.as_numpy("sentence_embedding")
                row[enc] = "ok"
            except Exception as e:  # noqa: BLE001 - recorded
                row[enc] = f"FAILS: {short(e)}"
            finally:
                client.close()
        out[kind] = row
    base = answers.get(("attnx", "json"))
    for (kind, enc), emb in answers.items():
        if base is not None and out[kind][enc] == "ok":
            out[kind][enc] = f"ok (max diff vs attnx {np.max(np.abs(emb - base)):.1e})"
    return out


def probe_endpoints(servers: dict) -> dict:
    """Health, metadata and metrics endpoints: status codes and what they say."""
    out = {}
    for kind, srv in servers.items():
        row = {}
        for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL_NAME}/ready", "/", "/v2",
                     f"/v2/models/{MODEL_NAME}/config", "/v2/models", "/v2/repository/index"):
            method = "POST" if path.endswith("index") else "GET"
            status, _, body = raw_request(srv.http, method, path, b"" if method == "POST" else None)
            row[f"{method} {path}"] = f"{status} {short(body.decode(errors='replace'), 120)}"
        status, _, body = raw_request(srv.http, "GET", f"/v2/models/{MODEL_NAME}")
        row["model metadata"] = f"{status} {short(body.decode(errors='replace'), 400)}"
        status, _, body = raw_request(srv.http, "GET", "/metrics")
        families = [ln.split()[2] for ln in body.decode(errors="replace").splitlines() if ln.startswith("# TYPE")]
        row["GET /metrics"] = f"{status}, {len(families)} families: {', '.join(f for f in families if not f.endswith('_created'))[:600]}"
        out[kind] = row
    return out


def probe_grpc(servers: dict, feeds, ref) -> dict:
    """tritonclient.grpc against each server's gRPC port (this process never imports kserve)."""
    import tritonclient.grpc as grpcclient

    out = {}
    for kind, srv in servers.items():
        if not srv.grpc:
            out[kind] = "no gRPC port"
            continue
        try:
            client = grpcclient.InferenceServerClient(srv.grpc)
            inputs = []
            for name, arr in feeds.items():
                i = grpcclient.InferInput(name, list(arr.shape), "INT64")
                i.set_data_from_numpy(arr)
                inputs.append(i)
            r = client.infer(MODEL_NAME, inputs, outputs=[grpcclient.InferRequestedOutput("sentence_embedding")])
            got = r.as_numpy("sentence_embedding")
            meta = client.get_model_metadata(MODEL_NAME, as_json=True)
            out[kind] = (f"infer ok (max diff {np.max(np.abs(got - ref)):.1e}); ready={client.is_server_ready()}; "
                         f"metadata inputs={[i['name'] for i in meta.get('inputs', [])]}")
            client.close()
        except Exception as e:  # noqa: BLE001 - recorded
            out[kind] = f"FAILS: {short(e)}"
    return out


def probe_proto_clash() -> str:
    """Import kserve and tritonclient.grpc in one fresh interpreter (both register the v2 protos)."""
    code = ("import kserve\ntry:\n    import tritonclient.grpc\n    print('ok')\n"
            "except Exception as e:\n    print(type(e).__name__ + ': ' + str(e).splitlines()[0])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, KSERVE_LOGLEVEL="WARNING"))
    return short((r.stdout.strip().splitlines() or [r.stderr.strip()[-200:]])[-1], 200)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_kserve-server"]:
        kserve_server_main(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an attnx export of all-MiniLM-L6-v2 (default: export it, ~20 s)")
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads in both servers")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per configuration")
    ap.add_argument("--seq-seconds", type=float, default=1.0, help="sequential client, seconds per round")
    ap.add_argument("--conc-seconds", type=float, default=1.5, help="concurrent clients, seconds per round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="one short round (under a minute with --model)")
    ap.add_argument("--kserve-logs", action="store_true", help="keep kserve's default INFO/access/latency logs")
    ap.add_argument("--json", type=Path, help="also write the numbers and probes here")
    args = ap.parse_args(argv)
    shapes = SHAPES
    if args.quick:  # one short round; no 1x128, and 8x128 by the sequential client only
        args.rounds, args.seq_seconds, args.conc_seconds = 1, 0.4, 0.5
        shapes = [s for s in SHAPES if s[0] != "1x128"]

    from rich.console import Console
    from rich.table import Table

    from attnx.deploy.loadtest import merge_results, run_load
    from attnx.runtime import load

    console = Console(width=200)
    t_start = time.perf_counter()
    servers: list[ServerProc] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model:
            model = args.model
        else:
            from attnx.export.pretrained import export_pretrained
            from attnx.pretrained import minilm_path

            t0 = time.perf_counter()
            model = export_pretrained(minilm_path(), tmp / f"{MODEL_NAME}.onnx").path
            console.print(f"[dim]exported all-MiniLM-L6-v2 in {time.perf_counter() - t0:.1f} s[/dim]")
        if Path(model).stem != MODEL_NAME:  # attnx serve names the model after the file
            link = tmp / f"{MODEL_NAME}.onnx"
            link.symlink_to(Path(model).resolve())
            tok = Path(model).with_name(f"{Path(model).stem}.tokenizer")
            if tok.is_dir():
                (tmp / f"{MODEL_NAME}.tokenizer").symlink_to(tok.resolve())
            model = link
        session = load(model, device="cpu", threads=args.threads)
        try:
            t0 = time.perf_counter()
            pairs: dict[int, dict[str, ServerProc]] = {}
            for mb in sorted({s[3] for s in shapes}):
                pairs[mb] = {"attnx": start_attnx(model, args.threads, mb, tmp / f"attnx{mb}.log"),
                             "kserve": start_kserve(model, args.threads, mb, tmp / f"kserve{mb}.log", args.kserve_logs)}
                servers += pairs[mb].values()
            for s in servers:
                s.wait_ready()
            console.print(f"[dim]{len(servers)} servers ready in {time.perf_counter() - t0:.1f} s "
                          f"(ORT threads {args.threads} each)[/dim]")

            rng = np.random.default_rng(0)
            pools = {}
            for label, b, n, mb in shapes:
                items = [token_feeds(b, n, rng) for _ in range(4)]
                refs = [session.run(f, ["sentence_embedding"])["sentence_embedding"] for f in items]
                pools[label] = ([(f, b, b * n) for f in items], refs, mb)

            main_pair = pairs[1]
            f16, _, _ = pools["1x16"][0][0]
            ref16 = pools["1x16"][1][0]
            encoding_probe = probe_encodings(main_pair, f16, ref16)
            # Each encoding is sent to both servers with whatever header kserve needs for it (if any).
            encodings = [(enc, h) for enc in CONTENT_TYPES if (h := headers_for(encoding_probe, enc)) is not False]
            results = []
            for label, b, n, mb in shapes:
                pool, refs, _ = pools[label]
                pair = pairs[mb]
                for enc, headers in encodings:
                    for k, srv in pair.items():  # warm-up: a couple of requests each
                        run_load(http_factory(srv.http, enc, headers), pool, concurrency=1, duration_s=0.05)
                    # 8-row requests with 16 clients: each round also waits out 16 x 8 rows in flight,
                    # so one round fewer (and none in --quick).
                    modes = [(1, args.seq_seconds, args.rounds),
                             (args.concurrency, args.conc_seconds, args.rounds if b == 1 else args.rounds - 1)]
                    for conc, secs, rounds in modes:
                        if rounds < 1:
                            continue
                        parts = {k: [] for k in pair}
                        cpu = {k: 0.0 for k in pair}
                        checkers = {k: Checker(refs) for k in pair}
                        for r in range(rounds):
                            order = list(pair) if r % 2 == 0 else list(pair)[::-1]
                            for k in order:
                                before = cpu_seconds(pair[k].proc.pid)
                                parts[k].append(run_load(http_factory(pair[k].http, enc, headers), pool,
                                                         concurrency=conc, duration_s=secs, seed=r,
                                                         verify=checkers[k]))
                                cpu[k] += cpu_seconds(pair[k].proc.pid) - before
                        for k in pair:
                            res = merge_results(parts[k], k)
                            results.append({"server": k, "shape": label, "encoding": enc, "clients": conc,
                                            "p50_ms": res.percentile_ms(50), "p99_ms": res.percentile_ms(99),
                                            "req_s": res.requests_per_s, "ok": res.ok,
                                            "cpu_ms_per_req": 1000 * cpu[k] / res.ok if res.ok else float("nan"),
                                            "errors": sum(res.errors.values()), "error_kinds": dict(res.errors),
                                            "mismatched": res.mismatched, "max_diff": checkers[k].max_diff})

            probes = {
                "JSON and binary tensors (tritonclient.http, 1x16)": encoding_probe,
                "BYTES text input": probe_text(main_pair),
                "errors": probe_errors(main_pair),
                "endpoints": probe_endpoints(main_pair),
                "gRPC (tritonclient.grpc)": probe_grpc(main_pair, f16, ref16),
                "kserve + tritonclient.grpc in one process": probe_proto_clash(),
            }
        finally:
            for s in servers:
                s.stop()

    table = Table(title=f"attnx vs kserve protocol layer: all-MiniLM-L6-v2, ORT threads {args.threads} per server, "
                        f"batching off, {args.rounds} interleaved round(s), {os.cpu_count()} CPUs",
                  title_justify="left")
    for col in ("server", "request", "encoding", "clients", "p50 ms", "p99 ms", "req/s", "p50 vs attnx",
                "req/s vs attnx", "server CPU ms/req", "CPU vs attnx", "ok", "errors", "wrong", "max diff"):
        table.add_column(col, justify="left" if col in ("server", "request", "encoding") else "right")
    by_key = {(r["server"], r["shape"], r["encoding"], r["clients"]): r for r in results}
    for r in results:
        base = by_key[("attnx", r["shape"], r["encoding"], r["clients"])]
        table.add_row(r["server"], r["shape"], r["encoding"], str(r["clients"]), f"{r['p50_ms']:.2f}",
                      f"{r['p99_ms']:.2f}", f"{r['req_s']:.1f}", f"x{r['p50_ms'] / base['p50_ms']:.2f}",
                      f"x{r['req_s'] / base['req_s']:.2f}" if base["req_s"] else "-", f"{r['cpu_ms_per_req']:.2f}",
                      f"x{r['cpu_ms_per_req'] / base['cpu_ms_per_req']:.2f}", str(r["ok"]),
                      str(r["errors"]), str(r["mismatched"]), f"{r['max_diff']:.1e}")
    console.print(table)
    for r in results:
        if r["server"] == "kserve" and r["clients"] == 1:
            base = by_key[("attnx", r["shape"], r["encoding"], 1)]
            console.print(f"protocol overhead {r['shape']} {r['encoding']}: kserve - attnx = "
                          f"{r['p50_ms'] - base['p50_ms']:+.2f} ms p50 latency, "
                          f"{r['cpu_ms_per_req'] - base['cpu_ms_per_req']:+.2f} ms server CPU per request",
                          highlight=False)
    for enc, headers in encodings:
        if headers:
            console.print(f"{enc} runs send {headers} to both servers (kserve needs it; see the probe)", highlight=False)
    for title, probe in probes.items():
        console.print(f"\n[bold]{title}[/bold]")
        if isinstance(probe, str):
            console.print(f"  {probe}", highlight=False, markup=False)
            continue
        for kind, row in probe.items():
            if isinstance(row, str):
                console.print(f"  {kind}: {row}", highlight=False, markup=False)
            else:
                for what, said in row.items():
                    console.print(f"  {kind:6} {what}: {said}", highlight=False, markup=False)
    console.print(f"[dim]total {time.perf_counter() - t_start:.0f} s[/dim]")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "probes": probes, "threads": args.threads,
                                         "rounds": args.rounds}, indent=2, default=str))
    failed = sum(r["errors"] + r["mismatched"] for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
