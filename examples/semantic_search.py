"""Semantic search against a running `attnx serve`, with the unmodified tritonclient (HTTP or gRPC).

Start a server for a text model (an export carries its tokenizer, so it takes text):

    attnx export --from-pretrained "$(python -c 'from attnx.pretrained import minilm_path; print(minilm_path())')" \
        --variant smal -o attnx-out/minilm-smal.onnx
    attnx serve minilm=attnx-out/minilm-smal.onnx --port 8000 --grpc-port 8001

then:

    python examples/semantic_search.py --model minilm --query "Will it rain tomorrow?"
    python examples/semantic_search.py --model minilm --grpc --url 127.0.0.1:8001 --corpus-file docs.txt

Queries and corpus go out as one BYTES tensor named "text"; only "sentence_embedding" comes back.
Context inputs a placed variant declares (smal's self_state, trace) are sent as seeded values here:
a placed variant starts neutral and ignores them; your service would send its real context.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

CORPUS = [
    "A man is eating a piece of bread.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "A woman is playing the violin.",
    "The new movie is awesome and the actors were great.",
    "The stock market fell sharply after the interest rate decision.",
    "How do I reset the password of my account?",
    "Heavy rain is expected across the north of the country tomorrow.",
]
#: Inputs the server derives from the text; any other input is a variant's context.
TEXT_DERIVED = {"text", "input_ids", "attention_mask", "token_type_ids", "position_ids"}


def embed(client, lib, model: str, texts: list[str], seed: int = 0) -> np.ndarray:
    """[len(texts), d] embeddings of ``texts`` from ``model``."""
    from tritonclient.utils import np_to_triton_dtype

    text = lib.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    inputs = [text]
    meta = client.get_model_metadata(model, **({"as_json": True} if lib.__name__.endswith("grpc") else {}))
    rng = np.random.default_rng(seed)
    for spec in meta["inputs"]:
        if spec["name"] in TEXT_DERIVED:
            continue
        shape = [len(texts), *(int(d) for d in spec["shape"][1:])]
        arr = (0.5 * rng.standard_normal(shape)).astype(np.float32) if spec["datatype"].startswith("FP") \
            else np.zeros(shape, np.int64)
        inputs.append(lib.InferInput(spec["name"], shape, np_to_triton_dtype(arr.dtype)))
        inputs[-1].set_data_from_numpy(arr)
    result = client.infer(model, inputs, outputs=[lib.InferRequestedOutput("sentence_embedding")])
    return result.as_numpy("sentence_embedding")


def search(query: np.ndarray, corpus: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` corpus rows most cosine-similar to ``query``: [(index, cosine)], best first."""
    scores = corpus @ query / (np.linalg.norm(corpus, axis=1) * np.linalg.norm(query))
    order = np.argsort(-scores, kind="stable")[:k]
    return [(int(i), float(scores[i])) for i in order]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="host:port of the server (default 127.0.0.1:8000, or :8001 with --grpc)")
    p.add_argument("--grpc", action="store_true", help="use tritonclient.grpc instead of HTTP")
    p.add_argument("--model", required=True, help="the served model's name")
    p.add_argument("--query", action="append", help="a query (repeatable; default: two examples)")
    p.add_argument("--corpus-file", help="one sentence per line (default: eight built-in sentences)")
    p.add_argument("--top-k", type=int, default=3)
    args = p.parse_args(argv)

    if args.grpc:
        import tritonclient.grpc as lib
    else:
        import tritonclient.http as lib
    url = args.url or ("127.0.0.1:8001" if args.grpc else "127.0.0.1:8000")
    queries = args.query or ["Will it rain tomorrow?", "I forgot my login details."]
    corpus = CORPUS
    if args.corpus_file:
        with open(args.corpus_file, encoding="utf-8") as f:
            corpus = [line.strip() for line in f if line.strip()]
    if not corpus or args.top_k < 1:
        p.error("need a non-empty corpus and --top-k >= 1")

    try:
        client = lib.InferenceServerClient(url)
        emb = embed(client, lib, args.model, queries + corpus)  # one request: queries and corpus together
    except Exception as e:  # a refused connection, an unknown model: one line, not a traceback
        print(f"error: {url}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    for q, query in enumerate(queries):
        print(f"query: {query}")
        for rank, (i, score) in enumerate(search(emb[q], emb[len(queries):], args.top_k), 1):
            print(f"  {rank}. {score:.4f}  {corpus[i]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
