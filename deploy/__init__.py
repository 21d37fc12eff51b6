"""Beyond one process: a Triton Inference Server model repository for an attnx model
(:mod:`~attnx.deploy.triton`, ``attnx triton-repo``) and the load generator behind ``attnx bench``
(:mod:`~attnx.deploy.loadtest`), which drives an in-process batcher or any KServe v2 server.
"""
