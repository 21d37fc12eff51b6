"""The served APIs over one model registry (:mod:`attnx.runtime.serving.registry`): KServe v2 (HTTP and gRPC),
OpenAI, TEI (HTTP and gRPC), Cohere/Jina rerank, Infinity classify, Triton generate, and the attention pages
(``explain``)."""
