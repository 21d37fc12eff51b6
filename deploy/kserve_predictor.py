"""attnx's runtime as a KServe custom predictor: kserve's Python ``ModelServer`` (Open Inference Protocol v2).

For a KServe cluster without Triton: the predictor container runs

    python -m attnx.deploy.kserve_predictor --model_name minilm --model_path /mnt/models/minilm-mha.onnx

and serves the model through attnx's batcher (requests of different lengths padded into one run). Its
model metadata declares the model's tensors (``GET /v2/models/{name}``: names, datatypes, shapes with
-1 where dynamic, batch included), which kserve's ``Model`` leaves empty unless the predictor says.
Tensors in, tensors out: the text routes are ``attnx serve``'s (and the Triton repository's ensembles).
kserve's own flags (``--http_port``, ``--enable_grpc``, ...) apply. The unmodified ``tritonclient`` works over
gRPC (outputs in ``raw_output_contents``, the only place its ``as_numpy`` reads) and over HTTP with binary or JSON
tensors (its JSON body comes without a Content-Type, which kserve alone would read as a binary body).
"""

from __future__ import annotations

import argparse
from typing import Any

import kserve
import kserve.errors
from kserve.utils.numpy_codec import from_np_dtype


class AttnxModel(kserve.Model):
    """One attnx model file behind kserve's ModelServer."""

    def __init__(self, name: str, path: str, *, device: str = "auto", threads: int | None = None, batching=None):
        super().__init__(name)
        self.path, self.device, self.threads, self.batching = path, device, threads, batching
        self.batcher = None
        self.load()

    def load(self) -> bool:
        from attnx.runtime import DynamicBatcher, load

        session = load(self.path, device=self.device, threads=self.threads)
        self.batcher = DynamicBatcher(session, self.batching, name=self.name)
        self.ready = True
        return self.ready

    def _types(self, specs) -> list[dict[str, Any]]:
        return [{"name": s.name, "datatype": from_np_dtype(s.dtype),
                 "shape": [d if isinstance(d, int) else -1 for d in s.shape]} for s in specs]

    def get_input_types(self) -> list[dict[str, Any]]:
        return self._types(self.batcher.session.inputs)

    def get_output_types(self) -> list[dict[str, Any]]:
        return self._types(self.batcher.session.outputs)

    async def predict(self, payload: kserve.InferRequest, headers=None, response_headers=None) -> kserve.InferResponse:
        from attnx.runtime import InputError

        feeds = {tensor.name: tensor.as_numpy() for tensor in payload.inputs}
        wanted = [o.name for o in payload.request_outputs] if payload.request_outputs else None
        try:
            outputs = await self.batcher.infer_async(feeds, output_names=wanted)
        except InputError as e:
            raise kserve.errors.InvalidInput(str(e)) from None
        answers = []
        for name, array in outputs.items():
            # REST: numpy data, written as the request asks (binary_data_output, or each requested output's
            # binary_data); gRPC: raw bytes, in raw_output_contents (the only place tritonclient's as_numpy reads)
            output = kserve.InferOutput(name, list(array.shape), from_np_dtype(array.dtype),
                                        data=None if payload.from_grpc else array)
            if payload.from_grpc:
                output.set_data_from_numpy(array, binary_data=True)
            answers.append(output)
        return kserve.InferResponse(response_id=payload.id or "", model_name=self.name, infer_outputs=answers,
                                    use_binary_outputs=payload.use_binary_outputs,
                                    requested_outputs=payload.request_outputs or None)

    def stop(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        self.ready = False


class JsonInferBody:
    """ASGI middleware: an infer body sent without a Content-Type and without ``Inference-Header-Content-Length``
    (tritonclient.http's all-JSON request) is JSON; kserve would take it for a binary body and refuse it (400
    "the 'inference-header-content-length' header is missing")."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].endswith("/infer"):
            names = {key.lower() for key, _ in scope["headers"]}
            if b"content-type" not in names and b"inference-header-content-length" not in names:
                scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(parents=[kserve.model_server.parser], description=__doc__.splitlines()[0])
    parser.add_argument("--model_path", required=True, help="the .onnx or .engine file")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args, _ = parser.parse_known_args(argv)
    model = AttnxModel(args.model_name, args.model_path, device=args.device)
    from kserve.model_server import app  # the ASGI app kserve's REST server serves

    app.add_middleware(JsonInferBody)
    kserve.ModelServer(http_port=args.http_port, grpc_port=args.grpc_port, enable_grpc=args.enable_grpc).start([model])


if __name__ == "__main__":
    main()
