"""Attention patterns and head ablation in the exported file (``attnx export --attention-outputs --head-mask``).

Export tools drop attention weights; attnx keeps them when asked. :class:`WithAttentionOutputs`
wraps any exportable model: it observes ``blocks.{i}.attn.hook_pattern`` of the chosen layers
(observing a pattern makes that layer take its explicit path, so the pattern is a real tensor
of the graph: for maw the selected depth's, for smal the modulated one) and returns them as
``attentions.{i}`` ``[batch, heads, seq, seq]``; with ``head_mask`` it adds the input
``head_mask [n_layers, heads]`` (1 = keep, 0 = ablate the head's output before ``W_O``).
A file exported without these options is the plain graph, unchanged.
"""

from __future__ import annotations

from torch import nn

from attnx.contract import Role
from attnx.models.hooks import hooks
from attnx.models.signature import InputSpec, OutputSpec


def parse_layers(value, n_layers: int) -> list[int]:
    """``"all"`` / ``None`` -> every layer; ``"0,3,5"`` or a list -> those (checked)."""
    if value is None or value == "all":
        return list(range(n_layers))
    items = value.replace(" ", "").split(",") if isinstance(value, str) else list(value)
    try:
        layers = sorted({int(i) for i in items if i != ""})
    except ValueError:
        raise ValueError(f"--attention-outputs {value!r}: expected all or layer indices like 0,3,5") from None
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad or not layers:
        raise ValueError(f"--attention-outputs: layer {bad[0] if bad else value!r} out of range: the model has "
                         f"{n_layers} layers (0..{n_layers - 1})")
    return layers


class WithAttentionOutputs(nn.Module):
    """``model`` plus outputs ``attentions.{i}`` for ``layers`` and, with ``head_mask``, that input."""

    def __init__(self, model: nn.Module, layers: list[int], head_mask: bool = False):
        super().__init__()
        self.model = model
        self.layers = list(layers)
        self.head_mask = head_mask
        self.variant = model.variant

    @property
    def blocks(self):
        return self.model.blocks

    def __getattr__(self, name):  # max_seq, metadata and the like come from the wrapped model
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)

    def input_specs(self) -> list[InputSpec]:
        specs = list(self.model.input_specs())
        if self.head_mask:
            n, h = len(self.model.blocks), self.model.blocks[0].config.n_heads
            specs.append(InputSpec("head_mask", (n, h), "float", Role.HEAD_MASK,
                                   "per layer and head: 1 keeps the head, 0 ablates it (its output before W_O)"))
        return specs

    def output_specs(self) -> list[OutputSpec]:
        return list(self.model.output_specs()) + [
            OutputSpec(f"attentions.{i}", ("batch", self.model.blocks[i].config.n_heads, "seq", "seq"), "float",
                       Role.AUX, f"layer {i}'s attention pattern (softmax over keys)") for i in self.layers]

    def config_dict(self) -> dict:
        return {**self.model.config_dict(), "attention_outputs": self.layers, "head_mask": self.head_mask}

    def forward_named(self, inputs: dict) -> dict:
        patterns = {}

        def saver(i):
            def save(x, hook):
                patterns[i] = x
            return save

        with hooks(self.model, [(f"blocks.{i}.attn.hook_pattern", saver(i)) for i in self.layers]):
            out = self.model.forward_named(inputs)
        return {**out, **{f"attentions.{i}": patterns[i] for i in self.layers}}
