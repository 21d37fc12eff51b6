"""A streamed export's initializers: each weight read from the source checkpoint when the file writer
writes it, never before (:mod:`attnx.pretrained.streamed` builds the model without its weights).

:func:`bind_initializers` runs right after translation, before any pass reads a value: every
initializer torch's exporter made from a bound parameter (found by the placeholder's storage, not by
name) becomes an ``ir.LazyTensor`` that reads that one tensor from the source and widens it to the
graph's dtype. The passes that follow (constant folding of small tensors, transposes, packed Q/K/V,
fp16, weight-only quantization) compose their own lazy tensors over it, so each weight is read and
transformed once, when it is written. A lazy tensor also carries ``attnx_torch``: the tensor as torch
holds it in the source's own dtype (a bf16 weight stays bf16), and ``attnx_read_rows(start, stop)`` where the
source reads a range of rows alone: quantization reads a large table a chunk of rows at a time; and
``attnx_blocks()`` / ``attnx_blocks_bits`` where the source holds MatMulNBits' own blocks (GGUF Q4_0, Q8_0), which
quantization carries over without re-rounding.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch


def binding_of(model):
    """The :class:`~attnx.pretrained.streamed.Binding` of the transformers model inside ``model``, or None."""
    for module in model.modules():
        binding = getattr(module, "attnx_source", None)
        if binding is not None:
            return module, binding
    return None, None


#: Source types whose blocks MatMulNBits takes as they are (:meth:`TensorSource.blocks`), and their bits.
CARRIED_BITS = {"Q4_0": 4, "Q8_0": 8}


def source_tensor(source, name: str, dtype: ir.DataType, shape, value_name: str,
                  source_dtype: str | None = None) -> ir.LazyTensor:
    """Tensor ``name`` of ``source``, widened/narrowed to ``dtype`` when it is evaluated."""
    torch_dtype = torch.from_numpy(np.zeros(0, dtype.numpy())).dtype

    def evaluate():
        return ir.Tensor(source.read(name).to(torch_dtype).numpy(), dtype=dtype, name=value_name)

    lazy = ir.LazyTensor(evaluate, dtype=dtype, shape=ir.Shape(list(shape)), name=value_name)
    lazy.attnx_torch = lambda: source.read(name)
    if hasattr(source, "read_rows") and len(shape) == 2:  # quantization reads it a chunk of rows at a time
        lazy.attnx_read_rows = lambda start, stop: source.read_rows(name, start, stop)
    if len(shape) == 2 and source_dtype in CARRIED_BITS:  # blocks MatMulNBits takes without re-rounding
        lazy.attnx_blocks, lazy.attnx_blocks_bits = (lambda: source.blocks(name)), CARRIED_BITS[source_dtype]
    return lazy


def _is_placeholder(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.numel() > 1 and all(s == 0 for s in tensor.stride())


def bind_initializers(graph: ir.Model, model) -> int:
    """Every initializer of ``graph`` made from a bound parameter of ``model`` read lazily from its source;
    returns how many. Refuses a graph still holding a placeholder's values (a weight the trace copied)."""
    hf, binding = binding_of(model)
    if binding is None:
        return 0
    params = dict(hf.named_parameters())
    infos = binding.source.infos()
    by_storage = {params[n].data_ptr(): src for n, src in binding.names.items() if n in params}
    bound = 0
    for value in list(graph.graph.initializers.values()):
        raw = getattr(value.const_value, "raw", None)
        if isinstance(raw, torch.Tensor) and raw.data_ptr() in by_storage:
            name = by_storage[raw.data_ptr()]
            value.const_value = source_tensor(binding.source, name, value.const_value.dtype, value.const_value.shape,
                                              value.name, infos[name].dtype)
            bound += 1
        elif _is_placeholder(raw):
            raise RuntimeError(f"initializer {value.name} holds a streamed weight the trace transformed; "
                               "export it with the model loaded whole")
    return bound
