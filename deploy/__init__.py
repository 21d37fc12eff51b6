"""Beyond one process: a Triton Inference Server model repository for an attnx model, all or nothing
(:mod:`~attnx.deploy.repository`, ``attnx triton-repo``; configs checked with Triton's schema in
:mod:`~attnx.deploy.triton`), a text model's Triton ensemble with its Python-backend tokenizer
(:mod:`~attnx.deploy.text_ensemble`, :mod:`~attnx.deploy.tokenizer_model`), a KServe InferenceService
(:mod:`~attnx.deploy.kserve`) or attnx's runtime as a KServe predictor (:mod:`~attnx.deploy.kserve_predictor`),
the model step of ``attnx triton-repo --backend python`` (:mod:`~attnx.deploy.runtime_model`), the server on
Ray Serve replicas (:mod:`~attnx.deploy.ray`), and the load generator behind ``attnx bench``
(:mod:`~attnx.deploy.loadtest`), which drives an in-process batcher or any KServe v2 server.
"""

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.deploy
    raise ImportError(f"import attnx.deploy, not {__name__}: the package is attnx (pip install -e .)")
