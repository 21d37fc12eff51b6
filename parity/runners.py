"""The Polygraphy runners a parity check compares (each a ``BaseRunner``, run by ``Comparator.run``):

- :class:`TorchReferenceRunner`: the PyTorch reference of an export (CPU, fp32, the literal
  formulas: :func:`attnx.models.attention.reference`), through ``model.forward_named``.
  Polygraphy's own PyTorch runner assumes CUDA. Besides the file's outputs it returns, for each
  exact output whose variant declares a decision margin (``ExtraOutput.margin``), the margin of
  every layer giving it: ``MARGIN_PREFIX + name``, ``[layers, batch]``.
- :func:`onnxrt_runner`: ONNX Runtime (CPU) on a file.
- :class:`EngineRunner`: a TensorRT engine through :class:`attnx.engine.Engine` (needs the GPU it
  was built for).

:func:`quiet_polygraphy` keeps Polygraphy's and ONNX Runtime's logging quiet while they run.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np

from attnx.contract import TensorEntry

#: Extra reference outputs: ``MARGIN_PREFIX + output`` holds that output's per-layer, per-row margins.
MARGIN_PREFIX = "__attnx_margin."
REFERENCE = "torch"


def _base_runner():
    from polygraphy.backend.base import BaseRunner

    return BaseRunner


def _metadata(inputs: Sequence[TensorEntry]):
    from polygraphy.common import TensorMetadata

    meta = TensorMetadata()
    for entry in inputs:
        shape = [d if isinstance(d, int) and d > 0 else None for d in entry.shape]
        meta.add(entry.name, dtype=np.dtype(entry.dtype), shape=shape)
    return meta


def margins(model) -> dict[str, np.ndarray]:
    """After a forward: ``{output: [layers, batch]}`` decision margins of every layer whose variant
    gives ``output`` with a ``margin`` (e.g. the top-1 minus top-2 policy logit of a depth choice)."""
    import torch

    found: dict[str, list] = {}
    for block in getattr(model, "blocks", []):
        for extra in block.spec.extra_outputs:
            if extra.margin is not None:
                found.setdefault(extra.name, []).append(extra.margin(block.attn).detach().float())
    return {name: torch.stack(values).numpy().astype(np.float32) for name, values in found.items()}


class TorchReferenceRunner(_base_runner()):
    """The PyTorch reference (CPU, fp32) of an attnx export, as a Polygraphy runner.

    Float inputs are run in fp32 whatever the file's precision (the reference of an fp16 file
    is the fp32 model on the same, fp16-rounded, inputs). ``float64=True`` runs a float64 copy of
    the model instead: how far the fp32 reference is from it measures how much the model itself
    amplifies fp32 rounding (:mod:`attnx.parity.text_report`)."""

    def __init__(self, model, inputs: Sequence[TensorEntry], outputs: Sequence[str], name: str = REFERENCE,
                 float64: bool = False):
        super().__init__(name=name, prefix="torch-reference")
        if float64:
            import copy

            model = copy.deepcopy(model).double()
        self.model = model.eval()
        self.float64 = float64
        self.inputs = list(inputs)
        self.output_names = list(outputs)

    @classmethod
    def from_onnx(cls, path: str | os.PathLike, name: str = REFERENCE) -> "TorchReferenceRunner":
        from attnx.parity.reference import load_reference

        model, info = load_reference(path)
        return cls(model, info.inputs, info.output_names, name=name)

    def activate_impl(self):
        pass

    def deactivate_impl(self):
        pass

    def get_input_metadata_impl(self):
        return _metadata(self.inputs)

    def infer_impl(self, feed_dict):
        import torch

        from attnx.models.attention import reference

        start = time.perf_counter()
        tensors = {}
        for name, arr in feed_dict.items():
            t = torch.from_numpy(np.ascontiguousarray(arr))
            if t.is_floating_point():
                t = t.double() if self.float64 else t.float()
            tensors[name] = t
        with torch.no_grad(), reference():
            result = self.model.forward_named(tensors)
        outputs = OrderedDict()
        for name in self.output_names:
            if name in result:
                value = result[name].detach()
                if value.is_floating_point() and not self.float64:
                    value = value.float()
                outputs[name] = value.numpy()
        for name, values in margins(self.model).items():
            outputs[MARGIN_PREFIX + name] = values
        self.inference_time = time.perf_counter() - start
        return outputs


@contextlib.contextmanager
def quiet_polygraphy(verbose: bool):
    """Polygraphy's and ONNX Runtime's logging silenced while runners run, unless ``verbose``."""
    from polygraphy.logger import G_LOGGER

    saved = G_LOGGER.module_severity
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - a dependency
        ort = None
    ort_saved = 2  # ONNX Runtime's default (warning); it has no getter
    if not verbose:
        G_LOGGER.module_severity = G_LOGGER.CRITICAL
        if ort is not None:
            ort.set_default_logger_severity(3)  # its constant-folding warnings on fp16 graphs are noise here
    try:
        yield
    finally:
        G_LOGGER.module_severity = saved
        if ort is not None:
            ort.set_default_logger_severity(ort_saved)


def onnxrt_runner(path: Path, name: str):
    """ONNX Runtime (CPU) on ``path``."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    return OnnxrtRunner(SessionFromOnnx(str(path), providers=["cpu"]), name=name)


class EngineRunner(_base_runner()):
    """A TensorRT engine through :class:`attnx.engine.Engine` (needs the GPU it was built for)."""

    def __init__(self, engine_path: str | os.PathLike, plugins: str | os.PathLike | bool | None = True,
                 name: str = "tensorrt"):
        super().__init__(name=name, prefix="tensorrt-engine")
        self.engine_path = Path(engine_path)
        self.plugins = plugins
        self.engine = None

    def open(self):
        """Deserialize now (raises ``EngineUnavailable`` where it cannot run)."""
        from attnx.engine.runner import deserialize

        if self.engine is None:
            self.engine = deserialize(self.engine_path, plugins=self.plugins)
        return self.engine

    def activate_impl(self):
        self.open()

    def deactivate_impl(self):
        pass  # the engine stays loaded between activations; close() frees it

    def close(self):
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def get_input_metadata_impl(self):
        from polygraphy.common import TensorMetadata

        meta = TensorMetadata()
        for t in self.engine.io_tensors:
            if t.is_input:
                meta.add(t.name, dtype=np.dtype(t.dtype), shape=[d if d >= 0 else None for d in t.shape])
        return meta

    def infer_impl(self, feed_dict):
        start = time.perf_counter()
        out = self.engine.run(feed_dict)
        self.inference_time = time.perf_counter() - start
        return OrderedDict((k, np.asarray(v)) for k, v in out.items())
