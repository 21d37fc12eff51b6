"""One in-process embedder, driven by ``bench_peers.py`` over stdin/stdout (one JSON object a line).

Run with the Python of the embedder's own venv: ``python _peer_worker.py KIND FOLDER ONNX THREADS``.
Kinds: ``attnx`` (``attnx.runtime.TextModel`` on the export), ``fastembed`` (``TextEmbedding`` with the same
ONNX file as a custom model, mean pooling, normalised), ``st-onnx`` (sentence-transformers with
``backend="onnx"``: Optimum's ``ORTModelForFeatureExtraction`` on the same file), ``st-torch``
(sentence-transformers' default PyTorch backend: the reference).

Request ``{"texts": [...], "emb": bool}`` -> ``{"s": seconds of the encode call, "emb": [[...]] | null}``;
the encode call of each library is timed here, so the pipe costs nothing to anyone. Imports nothing of
attnx unless the kind is attnx (the other venvs do not have it).
"""

from __future__ import annotations

import json
import sys
import time


def embedder(kind: str, folder: str, onnx_path: str, threads: int):
    """``encode(texts) -> [N, d]`` normalised float32 embeddings, as a user of ``kind`` calls it."""
    if kind == "attnx":
        from attnx.runtime import TextModel

        model = TextModel(onnx_path, threads=threads, device="cpu")
        return lambda texts: model.encode(texts, batch_size=len(texts), normalize_embeddings=True)
    if kind == "fastembed":
        import numpy as np
        from fastembed import TextEmbedding
        from fastembed.common.model_description import ModelSource, PoolingType

        name = "attnx-bench/all-MiniLM-L6-v2"
        TextEmbedding.add_custom_model(name, pooling=PoolingType.MEAN, normalization=True,
                                       sources=ModelSource(hf=name), dim=384, model_file="onnx/model.onnx",
                                       output_name="last_hidden_state")
        model = TextEmbedding(name, specific_model_path=folder, threads=threads, local_files_only=True)
        return lambda texts: np.stack(list(model.embed(texts, batch_size=len(texts))))
    if kind in ("st-onnx", "st-torch"):
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        kw = {"backend": "onnx", "model_kwargs": {"file_name": "onnx/model.onnx", "provider": "CPUExecutionProvider"}} \
            if kind == "st-onnx" else {}
        model = SentenceTransformer(folder, device="cpu", local_files_only=True, **kw)
        return lambda texts: model.encode(texts, batch_size=len(texts), normalize_embeddings=True,
                                          convert_to_numpy=True)
    raise SystemExit(f"unknown kind {kind!r}")


def main() -> None:
    kind, folder, onnx_path, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    encode = embedder(kind, folder, onnx_path, threads)
    encode(["warm up"])
    print(json.dumps({"ready": kind}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        emb = encode(request["texts"])
        seconds = time.perf_counter() - start
        print(json.dumps({"s": seconds, "emb": emb.tolist() if request.get("emb") else None}), flush=True)


if __name__ == "__main__":
    main()
