"""The exporter promotes types from the trace's values (attnx.export.type_promotion): the program torch's own
pass leaves, node for node, without running the program again."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attnx.export import type_promotion


class Mixed(torch.nn.Module):
    """What torch's pass inserts: a scalar into a float op as a tensor of its dtype (float32 and float16), an
    int tensor into a float op cast; and ops that need nothing."""

    def forward(self, x, ids, h):
        y = x * 2 + ids  # scalar_tensor(2, float32); ids cast to float32
        z = (h * h + 1.5).float()  # scalar_tensor(1.5, float16)
        return y.softmax(-1) + z, (ids * 3).sum(-1)


def _program(module, *args):
    batch = torch.export.Dim("batch", min=1, max=64)
    return torch.export.export(module, args, dynamic_shapes=tuple({0: batch} for _ in args), strict=False)


def _summary(program) -> list[tuple]:
    """Each node: its name, target, arguments and the dtype and shape of its value."""
    out = []
    for node in program.graph.nodes:
        val = node.meta.get("val")
        kind = (val.dtype, tuple(str(s) for s in val.shape)) if isinstance(val, torch.Tensor) else repr(val)
        out.append((node.name, str(node.target), str(node.args), str(node.kwargs), kind))
    return out


def _inputs():
    return torch.randn(3, 5), torch.arange(15).view(3, 5), torch.randn(3, 5).half()


def test_the_program_is_the_one_torchs_pass_leaves():
    from torch.onnx._internal.exporter import _fx_passes

    args = _inputs()
    theirs, ours = _program(Mixed(), *args), _program(Mixed(), *args)
    before = {n.name for n in ours.graph.nodes}
    _fx_passes.insert_type_promotion_nodes(theirs.graph_module)
    type_promotion.insert_type_promotion_nodes(ours.graph_module)
    assert _summary(ours) == _summary(theirs)
    inserted = sorted(str(n.target) for n in ours.graph.nodes if n.name not in before)
    assert inserted == ["aten.scalar_tensor.default"] * 2 + ["prims.convert_element_type.default"], inserted
    want = Mixed()(*args)
    for a, b in zip(ours.module()(*args), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nothing_runs_where_nothing_is_promoted(monkeypatch):
    """A program with no implicit promotion: no operator of it is executed again."""

    class Plain(torch.nn.Module):
        def forward(self, x):
            return (x @ x.transpose(0, 1)).softmax(-1) * 0.5

    program = _program(Plain(), torch.randn(3, 5))
    ran = []
    real = torch.fx.Interpreter.run_node
    monkeypatch.setattr(torch.fx.Interpreter, "run_node", lambda self, n: ran.append(n.op) or real(self, n))
    before = _summary(program)
    type_promotion.insert_type_promotion_nodes(program.graph_module)
    assert "call_function" not in ran, ran
    assert _summary(program) == before


def test_the_exporter_translates_it_to_what_torch_computes(tmp_path):
    import onnxruntime as ort

    args = _inputs()
    with type_promotion.promotion_from_the_trace():
        torch.onnx.export(_program(Mixed(), *args), args, dynamo=True, optimize=False,
                          verbose=False).save(str(tmp_path / "ours.onnx"))
    torch.onnx.export(_program(Mixed(), *args), args, dynamo=True, optimize=False,
                      verbose=False).save(str(tmp_path / "theirs.onnx"))
    feeds = {"x": args[0][:2].numpy(), "ids": args[1][:2].numpy(), "h": args[2][:2].numpy()}
    runs = [ort.InferenceSession(str(tmp_path / f"{who}.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
            for who in ("ours", "theirs")]
    for a, b, want in zip(*runs, Mixed()(*(t[:2] for t in args))):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, want.numpy(), rtol=2e-3, atol=2e-3)  # ORT's float16 arithmetic is not torch's
