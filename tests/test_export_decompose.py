"""The exporter skips torch's second trace when a program needs no decomposition (attnx.export.decompose):
the same ONNX outputs to the bit as the full decomposition, and the full one where anything is left."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from attnx.export import decompose
from hf_folders import make_folder


def _program(module, *args):
    batch = torch.export.Dim("batch", min=1, max=64)
    return torch.export.export(module, args, dynamic_shapes=tuple({0: batch} for _ in args), strict=False)


def _translated() -> set:
    from torch.onnx._internal.exporter import _decomp, _registration

    return set(_decomp.get_onnx_implemented_overloads(_registration.ONNXRegistry.from_torchlib()))


class Renamed(torch.nn.Module):
    def forward(self, x, ids):
        keep = (ids > 2) & (ids < 9)  # aten.__and__
        y = (1.0 - x) * keep.to(x.dtype) + x.square()  # aten.rsub, aten.to, aten.square
        return y.to(torch.float32) @ torch.eye(5), ids.to(torch.float32)  # a cast to what it is: no node


def test_the_renamed_operators_compute_what_they_did(tmp_path):
    import onnxruntime as ort

    x, ids = torch.randn(3, 5), torch.arange(15).view(3, 5)
    program = _program(Renamed(), x, ids)
    before = program.module()(x, ids)
    with decompose.only_what_onnx_lacks():  # the renamed program, translated by torch's exporter
        torch.onnx.export(_program(Renamed(), x, ids), (x, ids), dynamo=True, optimize=False,
                          verbose=False).save(str(tmp_path / "m.onnx"))
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x[:2].numpy(), "ids": ids[:2].numpy()})
    for a, b in zip(Renamed()(x[:2], ids[:2]), got):
        np.testing.assert_array_equal(a.numpy(), b)
    assert decompose.why_not_ready(program, _translated()) is None
    decompose.rename(program)
    targets = {n.target for n in program.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert not targets & {aten.__and__.Tensor, aten.rsub.Scalar, aten.to.dtype, aten.to.device,
                          aten.to.dtype_layout, aten.eye.default, aten.square.default}, targets
    assert {aten.bitwise_and.Tensor, aten.neg.default, aten._to_copy.default, aten.arange.default} <= targets
    after = program.module()(x, ids)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class Mutates(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(5))

    def forward(self, x):
        self.seen.add_(x.sum(0))
        return x * 2


class Eye(torch.nn.Module):
    def forward(self, x):
        return x @ torch.eye(5, 4)  # eye.m: not renamed


@pytest.mark.parametrize(("module", "why"), [(Mutates(), "aten.add_.Tensor mutates"),
                                             (Eye(), "aten.eye.m has no ONNX translation")])
def test_a_program_that_needs_decomposing_gets_torchs_full_one(module, why, tmp_path):
    import onnxruntime as ort

    x = torch.randn(3, 5)
    program = _program(module, x)
    assert decompose.why_not_ready(program, _translated()) == why
    with decompose.only_what_onnx_lacks():
        onnx_program = torch.onnx.export(program, (x,), dynamo=True, optimize=False, verbose=False)
    onnx_program.save(str(tmp_path / "m.onnx"))
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy()})
    np.testing.assert_allclose(got[-1], (x @ torch.eye(5, 4) if why.startswith("aten.eye") else x * 2).numpy(),
                               rtol=1e-6, atol=1e-6)


def _outputs(path, feeds):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_a_placed_decoder_exports_to_the_same_outputs_either_way(tmp_path, monkeypatch):
    """llama with cultural (casts, ``&``, ``1 - g``): the skipped retrace and torch's full decomposition give
    the same operators and the same outputs to the bit; the skip is what an export takes."""
    from attnx.export.pretrained import export_pretrained

    folder = make_folder("llama", tmp_path / "src")
    taken = []
    real = decompose.why_not_ready
    monkeypatch.setattr(decompose, "why_not_ready", lambda *a: taken.append(real(*a)) or taken[-1])
    fast = export_pretrained(folder, tmp_path / "fast.onnx", variant="cultural", copy_weights=True).path
    assert taken == [None]
    monkeypatch.setattr(decompose, "why_not_ready", lambda *a: "asked for the full decomposition")
    full = export_pretrained(folder, tmp_path / "full.onnx", variant="cultural", copy_weights=True).path
    ops = [collections.Counter(n.op_type for n in onnx.load(str(p), load_external_data=False).graph.node)
           for p in (fast, full)]
    assert ops[0] == ops[1], (ops[0] - ops[1], ops[1] - ops[0])
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 150, (3, 9))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    feeds = {"input_ids": ids, "attention_mask": mask}
    session = __import__("onnxruntime").InferenceSession(str(fast), providers=["CPUExecutionProvider"])
    for spec in session.get_inputs():
        if spec.name not in feeds:
            shape = [3 if not isinstance(d, int) else d for d in spec.shape]
            feeds[spec.name] = rng.random(shape).astype(np.float32) if "float" in spec.type else np.ones(shape, np.int64)
    a, b = _outputs(fast, feeds), _outputs(full, feeds)
    assert np.abs(a[0]).max() > 0.1
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
