"""The model step of ``attnx triton-repo --backend python``: attnx's runtime inside Triton's Python backend.

``attnx triton-repo`` copies this file, unchanged, to ``<model>/1/model.py`` beside the model file. It
serves an export (or a foreign ONNX file) where Triton has no ONNX Runtime backend, an ONNX file with
attnx's custom ops on whatever ONNX Runtime the stub's Python has, and an attnx TensorRT engine with
its plugin library, all through :func:`attnx.runtime.load`.

Triton's dynamic batcher hands :meth:`TritonPythonModel.execute` the requests it collected. The
sequence inputs are declared ``allow_ragged_batch``, so those requests may differ in length: they are
padded to a common length (token ids with the pad id, the attention mask with 0), run once, and each
request's outputs are cut back to its own rows and length (:class:`attnx.runtime.BatchLayout`, what
``attnx serve``'s batcher does), so an answer equals the request run alone. Requests whose other dims
differ, or whose lengths are more than ``max_length_ratio`` apart, run as separate batches. A request
with bad inputs gets its own error (INVALID_ARG); if a merged run fails, each of its requests runs
alone, so only the culprit fails. An input a request leaves out is filled as ``attnx serve`` fills it
(an all-ones mask, one segment, a context input's metadata default).

Parameters of its ``config.pbtxt`` (strings, as Triton passes them):

- ``model_file``: the file in the version folder (``model.onnx`` or ``model.plan``), and for an engine
  ``onnx_file`` when its sidecar does not list its tensors;
- ``pad_id``: what padded token ids hold (the export's tokenizer's pad id);
- ``max_length_ratio``: longest / shortest length in one run (padding costs compute);
- ``plugin_library``: an engine's TensorRT plugin library, relative to the model folder;
- ``threads``: ONNX Runtime's intra-op threads per instance (empty: attnx's default).

It needs ``attnx`` (and ``onnxruntime``) in the Python that runs Triton's stub, and a numpy the stub
can read (numpy<2 for Triton 2.51's stub: :func:`attnx.deploy.tokenizer_model.check_stub_numpy`).
A GPU instance (``KIND_GPU``) runs on its device alone: the stub is a process per instance, so
``CUDA_VISIBLE_DEVICES`` is set to the instance's device before anything touches CUDA.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside Triton: attnx only ships this file
    pb_utils = None


def length_groups(items: list, ratio: float | None) -> list[list[int]]:
    """Indices of ``items`` (``Prepared``: ``key``, ``length``) in runs that can share a batch: the same
    key, and lengths within ``ratio`` of each other (shortest first)."""
    by_key: dict = {}
    for index, item in enumerate(items):
        by_key.setdefault(item.key, []).append(index)
    groups = []
    for indices in by_key.values():
        indices.sort(key=lambda i: items[i].length or 0)
        group = [indices[0]]
        for i in indices[1:]:
            shortest, length = items[group[0]].length, items[i].length
            if ratio is not None and shortest and length and length > ratio * shortest:
                groups.append(group)
                group = []
            group.append(i)
        groups.append(group)
    return groups


class TritonPythonModel:
    """Triton's entry points: ``initialize`` once per instance, ``execute`` per batch of requests."""

    def initialize(self, args: dict) -> None:
        from attnx.deploy.tokenizer_model import check_stub_numpy

        check_stub_numpy()
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        model_dir = Path(args["model_repository"]).resolve()
        version_dir = model_dir / str(args["model_version"])
        if args.get("model_instance_kind") == "GPU":
            os.environ["CUDA_VISIBLE_DEVICES"] = str(args.get("model_instance_device_id", "0"))
        if params.get("plugin_library"):
            os.environ["ATTNX_PLUGIN_LIB"] = str(_inside(model_dir, params["plugin_library"]))

        from attnx.runtime import BatchLayout, load

        path = _inside(version_dir, params.get("model_file") or "model.onnx")
        options: dict = {}
        if path.suffix == ".onnx":
            options = {"device": "cuda" if args.get("model_instance_kind") == "GPU" else "cpu",
                       "threads": int(params["threads"]) if params.get("threads") else None}
        elif params.get("onnx_file"):
            options = {"onnx_path": _inside(version_dir, params["onnx_file"])}
        self.session = load(path, **options)
        pad_id = int(params["pad_id"]) if params.get("pad_id") else None
        self.layout = BatchLayout.of(self.session, pad_id)
        self.ratio = float(params["max_length_ratio"]) if params.get("max_length_ratio") else None
        self.outputs = {o["name"]: pb_utils.triton_string_to_numpy(o["data_type"]) for o in config["output"]}

    def execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        prepared, placed = [], []  # each good request's Prepared, and its index in ``requests``
        for index, request in enumerate(requests):
            try:
                feeds = {t.name(): t.as_numpy() for t in request.inputs()}
                prepared.append(self.layout.prepare(self.session.check_feeds(feeds)))
                placed.append(index)
            except ValueError as e:  # attnx's InputError: names, dtypes, dims, id ranges
                responses[index] = _error(str(e), "INVALID_ARG")
        for group in length_groups(prepared, self.ratio):
            for member, answer in zip(group, self._run([prepared[i] for i in group])):
                responses[placed[member]] = answer
        return responses

    def _run(self, items: list) -> list:
        """One merged run for ``items``; if it fails, each alone (only the culprit fails)."""
        try:
            merged, _ = self.layout.merge(items)
            results = self.layout.split(self.session.run(merged, list(self.outputs)), items)
        except Exception as e:  # noqa: BLE001 - every request must be answered
            if len(items) > 1:
                return [self._run([item])[0] for item in items]
            return [_error(f"{type(e).__name__}: {e}", "INVALID_ARG" if isinstance(e, ValueError) else "INTERNAL")]
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(name, np.ascontiguousarray(result[name].astype(dtype, copy=False)))
            for name, dtype in self.outputs.items()]) for result in results]

    def finalize(self) -> None:
        self.session.close()


def _inside(folder: Path, name: str) -> Path:
    """``folder / name``, refused when it leaves ``folder`` (a config is data, not a path to anywhere)."""
    path = (folder / name).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise ValueError(f"{name!r} is outside {folder}")
    return path


def _error(message: str, code: str):
    """An error response with Triton's code where this Triton has error codes (23.09 on)."""
    kind = getattr(pb_utils.TritonError, code, None)
    error = pb_utils.TritonError(message) if kind is None else pb_utils.TritonError(message, kind)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
