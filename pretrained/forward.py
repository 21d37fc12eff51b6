"""What runs during a placed model's forward: the hooks :func:`attnx.pretrained.place` registers.

They are module-level functions that read their state from the module they are called on (its
``attnx``, ``attnx_layer`` and ``attnx_hook_embed`` children), so a deepcopy of a placed model, whose
hooks are copied by reference, works on its own modules. The state of one forward that transformers
does not pass to attention lives in the :class:`attnx.pretrained.backend.Call` they open and close.
"""

from __future__ import annotations

import inspect

import torch

from attnx.pretrained import backend


def _hidden_arg(args, kwargs):
    return args[0] if args else kwargs.get("hidden_states")


def _with_hidden(args, kwargs, value):
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def _first(output):
    return output if isinstance(output, torch.Tensor) else output[0]


def _with_first(output, value):
    if isinstance(output, torch.Tensor):
        return value
    if isinstance(output, tuple):
        return (value, *output[1:])
    output[0] = value  # a ModelOutput
    return output


def embeddings_post(module, args, output):
    return module.attnx_hook_embed(output) if isinstance(output, torch.Tensor) else None


def attention_pre(module, args, kwargs):
    call = backend._CALL.get()
    if call is not None:
        call.hidden[id(module.attnx)] = _hidden_arg(args, kwargs)


def layer_pre(layer, args, kwargs):
    hooks = layer.attnx_layer
    if hooks.first:
        # One Call per forward, opened by the first layer: a caller may bypass the model's own hooks
        # (sentence-transformers calls ``model.forward`` directly), but every family calls its layers.
        backend.open_forward()
    x = _hidden_arg(args, kwargs)
    x_hooked = hooks.hook_resid_pre(x)
    call = backend._CALL.get()
    if call is not None and hooks.fusion is not None:
        call.layer_inputs[hooks.index] = x_hooked
    if x_hooked is not x:
        return _with_hidden(args, kwargs, x_hooked)
    return None


def layer_post(layer, args, kwargs, output):
    hooks = layer.attnx_layer
    try:
        if output is None:  # the layer raised (an always_call hook still runs): only close the forward
            return None
        y = _first(output)
        call = backend.current_call()
        if hooks.fusion is not None:
            ctx = backend._context_for(hooks.fusion, call, y.shape[0])
            y = hooks.fusion(call.layer_inputs[hooks.index], y, **ctx)
        y = hooks.hook_resid_post(y)
        if hooks.appended is not None:
            for j, block in enumerate(hooks.appended):
                head_mask = None if call.head_mask is None else call.head_mask[hooks.index + 1 + j]
                ctx = backend._context_for(block.attn, call, y.shape[0])
                if call.cache is not None:  # a decoder's cached step: the block's own k/v are cached too
                    y = call.cache.run_appended(block, hooks.index + 1 + j, y, call.tokens, head_mask, ctx)
                else:
                    y = block(y, call.tokens, head_mask, **ctx)
        return _with_first(output, y)
    finally:
        if hooks.last:
            backend.close_forward()


def model_pre(model, args, kwargs):
    names = getattr(model, "attnx_context", ())
    context = {n: kwargs.pop(n) for n in names if n in kwargs}
    tokens = kwargs.get("attention_mask")
    if tokens is None and len(args) > 1:
        try:
            tokens = inspect.signature(model.forward).bind_partial(*args).arguments.get("attention_mask")
        except TypeError:
            tokens = None
    if tokens is not None and tokens.dim() != 2:
        tokens = None  # a 4-D mask of the caller's own: no token mask to pool with
    stack = model.__dict__.setdefault("_attnx_calls", [])
    stack.append(backend._CALL.set(backend.current_call().extended(context, tokens)))
    return args, kwargs


def model_post(model, args, kwargs, output):
    stack = model.__dict__.get("_attnx_calls")
    if stack:
        backend._CALL.reset(stack.pop())
    return None
