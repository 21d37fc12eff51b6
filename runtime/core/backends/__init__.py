"""The runtimes behind :class:`attnx.runtime.core.session.Session`, one module each: ONNX Runtime
(:mod:`~attnx.runtime.core.backends.onnxrt`) and TensorRT engines (:mod:`~attnx.runtime.core.backends.tensorrt`).
Each gives the session class, a loader of the file's I/O specs without running it, and its options."""
