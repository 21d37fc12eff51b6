"""A GGUF file's tensors, one at a time, as transformers' model of it names and holds them.

    source = GgufSource("SmolLM2-135M-Instruct.Q4_1.gguf")
    source.infos()["model.layers.0.self_attn.q_proj.weight"]    # TensorInfo(shape=(576, 576), dtype="Q4_1")
    source.read("model.layers.0.self_attn.q_proj.weight")       # float32, exactly transformers' tensor
    source.blocks("model.layers.0.self_attn.k_proj.weight")     # Q4_0 / Q8_0: MatMulNBits blocks, else None

This is :mod:`attnx.pretrained.tensors`' ``TensorSource`` for a GGUF (the export reads weights through it, so
a GGUF never becomes an fp32 folder). Everything that makes a tensor transformers' tensor is transformers'
own code, called here one tensor at a time: its GGUF name map (``get_gguf_hf_weights_map`` on a meta-device
model of the config's class) and its per-architecture tensor processor (Llama's Q/K row order, Gemma's norm
offset, ...), after the ``gguf`` package's ``dequantize`` of the tensor's blocks. :meth:`GgufSource.read` is
therefore bit for bit the tensor ``from_pretrained(..., gguf_file=...)`` loads (tests/test_gguf_tensors.py).

Q4_0 and Q8_0 blocks (32 weights, one fp16 scale, symmetric) are ONNX Runtime's ``MatMulNBits`` blocks with
the default zero point: :meth:`GgufSource.blocks` re-lays them into its ``B`` layout without re-rounding, in
the row order transformers' processor gives (found by passing row numbers through it: a processor that does
anything but reorder rows gets no blocks).

Memory: the file's bytes are read with ``os.preadv`` into fresh buffers, never through a memory map, so
reading a model's tensors one after the other leaves no file pages in this process's RSS; blocks are
dequantized a bounded number of rows at a time into the one float32 result (the ``gguf`` package's own
intermediates are several times a tensor's size). The metadata (a ``GGUFReader``, seconds for a large
vocabulary) is parsed once per file and process (:func:`reader_of`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import numpy as np

from attnx.pretrained.gguf_marker import gguf_of
from attnx.pretrained.limits import check_limits
from attnx.pretrained.tensor_types import Blocks, TensorInfo

#: the block types :meth:`GgufSource.blocks` carries over: ggml name -> bits per weight
CARRIED = {"Q4_0": 4, "Q8_0": 8}
BLOCK = 32
#: rows re-laid per step (bounds the working set of a 128k-row embedding)
_ROWS = 8192
#: values dequantized per step (64 MB of float32)
_DEQUANT_VALUES = 1 << 24


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


@contextlib.contextmanager
def transformers_reading(reader):
    """transformers' GGUF loaders (config, tokenizer) reading through ``reader`` (one parse of the file's
    metadata, ~100k tokenizer strings, serves them all), quietly: the loader logs every metadata key it does
    not map and draws its own progress bar."""
    import gguf as gguf_package
    import transformers
    from transformers import modeling_gguf_pytorch_utils as loader

    transformers.utils.logging.disable_progress_bar()
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    bar, reader_class = loader.tqdm, gguf_package.GGUFReader
    mine = str(Path(reader.data.filename).resolve())
    loader.tqdm = lambda it, **kw: it

    def shared(path, *a, **kw):
        return reader if str(Path(path).resolve()) == mine else reader_class(path, *a, **kw)

    gguf_package.GGUFReader = shared
    try:
        yield
    finally:
        quiet.setLevel(level)
        loader.tqdm, gguf_package.GGUFReader = bar, reader_class


@contextlib.contextmanager
def _one_name_map():
    """transformers' ``get_gguf_hf_weights_map`` builds gguf's name map (~18k formatted names) again for every
    submodule it recurses into (397 for a 30-layer Llama: 7 s); the map depends only on (arch, layers)."""
    import functools

    import gguf as gguf_package

    original = gguf_package.get_tensor_name_map
    gguf_package.get_tensor_name_map = functools.lru_cache(maxsize=4)(original)
    try:
        yield
    finally:
        gguf_package.get_tensor_name_map = original


_READERS: dict = {}  # (path, size, mtime_ns) -> the last file's parsed GGUFReader


def reader_of(path: Path):
    """A ``GGUFReader`` of ``path``, the last one reused while the file is unchanged (an export opens the same
    file's source more than once; each parse of a large vocabulary takes seconds)."""
    import gguf as gguf_package

    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _READERS:
        _READERS.clear()
        _READERS[key] = gguf_package.GGUFReader(path)
    return _READERS[key]


def causal_lm_class(config, where):
    """transformers' causal LM class for ``config`` (one line naming ``where`` if it has none)."""
    import transformers

    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        raise ValueError(f"{where}: transformers has no causal LM for its model_type {config.model_type!r}") \
            from None


class GgufSource:
    """The tensors of the GGUF file ``path`` (see the module doc). ``config``: transformers' config of it when
    the caller has it already (the cached folder's), else read from the file; ``reader``: a ``GGUFReader`` of
    it already parsed (parsing a 50k-token vocabulary takes seconds)."""

    def __init__(self, path: str | os.PathLike, config=None, reader=None):
        import transformers
        from transformers import modeling_gguf_pytorch_utils as loader

        self.path = Path(path).expanduser()
        try:
            self._reader = reader if reader is not None else reader_of(self.path)
        except Exception as e:  # numpy, struct and ValueError from a broken file
            raise ValueError(f"{self.path}: not a readable GGUF file ({_one_line(e)})") from None
        try:
            with transformers_reading(self._reader):
                # the loader's own parse of the metadata: exactly the config its tensor processor gets
                parsed = loader.load_gguf_checkpoint(str(self.path), return_tensors=False)
                if config is None:
                    config = transformers.AutoConfig.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                                     local_files_only=True)
        except Exception as e:  # the gguf reader and transformers raise many types on a broken file
            raise ValueError(f"{self.path}: transformers cannot read it as a GGUF model ({_one_line(e)})") from None
        check_limits(config.to_dict(), self.path)
        architecture = loader.read_field(self._reader, "general.architecture")[0]
        self._processor = loader.TENSOR_PROCESSORS.get(architecture, loader.TensorProcessor)(config=parsed["config"])
        import torch

        with torch.device("meta"):  # names and shapes only: no memory
            model = causal_lm_class(config, self.path)(config)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        with _one_name_map():
            self._mapping = loader.get_gguf_hf_weights_map(model, self._processor)
        del model
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._sources: dict[str, list[str]] = {}  # transformers' name -> the GGUF tensors it is made of
        for name, tensor in self._tensors.items():
            for hf in self._targets(name, tensor):
                self._sources.setdefault(hf, []).append(name)
        self._infos = {}
        for hf, names in self._sources.items():
            if hf not in shapes:
                continue  # transformers' loader skips it too
            tensor = self._tensors[names[0]]
            if len(names) == 1 and int(tensor.n_elements) != int(np.prod(shapes[hf], dtype=np.int64)):
                raise ValueError(f"{self.path}: tensor {names[0]} has {int(tensor.n_elements)} values, transformers' "
                                 f"{hf} {list(shapes[hf])} holds {int(np.prod(shapes[hf], dtype=np.int64))}")
            self._infos[hf] = TensorInfo(shapes[hf], tensor.tensor_type.name)
        self._fd = os.open(self.path, os.O_RDONLY)

    @classmethod
    def for_folder(cls, folder: str | os.PathLike) -> "GgufSource":
        """The source of a GGUF-backed folder (:func:`attnx.pretrained.gguf.as_folder`), with the folder's
        config; one line if its GGUF is gone or changed."""
        import transformers

        path = gguf_of(folder)
        if path is None:
            raise ValueError(f"{folder}: not a GGUF-backed folder (no attnx-gguf.json)")
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        return cls(path, config=config)

    # ------------------------------------------------------------------ names

    def _targets(self, name: str, tensor) -> list[str]:
        """The transformers names the GGUF tensor ``name`` goes to. Most go through the name map; a few
        processors (GPT-2's output, MoE experts) write into transformers' dict themselves: those are found
        by running the processor on a one-value-per-axis stand-in."""
        if name in self._mapping:
            return [self._mapping[name]]
        parsed = {"tensors": {}}
        try:
            result = self._processor.process(weights=np.zeros((1,) * len(tensor.shape), np.float32), name=name,
                                             tensor_key_mapping=self._mapping, parsed_parameters=parsed)
        except Exception:  # a processor that needs the real shape: transformers would not map it either
            return []
        if result.name is not None and result.name in self._mapping:
            return [self._mapping[result.name]]
        return list(parsed["tensors"])

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    # ------------------------------------------------------------------ reading

    def _raw(self, tensor) -> np.ndarray:
        """The tensor's bytes in fresh memory, shaped as the gguf reader shapes them."""
        import gguf as gguf_package

        buf = np.empty(int(tensor.n_bytes), np.uint8)
        view, offset = memoryview(buf), int(tensor.data_offset)
        while view.nbytes:
            got = os.preadv(self._fd, [view], offset)
            if got <= 0:
                raise ValueError(f"{self.path}: ends inside tensor {tensor.name} (truncated file)")
            view, offset = view[got:], offset + got
        kind = tensor.tensor_type
        dims = tuple(reversed([int(d) for d in tensor.shape]))
        plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}.get(kind.name)
        if plain is not None:
            return buf.view(plain).reshape(dims)
        return buf.reshape(gguf_package.quants.quant_shape_to_byte_shape(dims, kind))

    def _dequantized(self, raw: np.ndarray, tensor) -> np.ndarray:
        """``gguf``'s ``dequantize`` of ``raw``, a bounded number of rows at a time into one float32 array: the
        package's intermediates are several times a whole tensor's float32 size (GBs for an 8B model's
        embedding); blocks never span rows, so the values are the same."""
        import gguf as gguf_package

        dims = tuple(reversed([int(d) for d in tensor.shape]))
        if len(dims) < 2 or raw.dtype != np.uint8:  # plain floats (a view) and vectors: as they are
            return gguf_package.quants.dequantize(raw, tensor.tensor_type)
        out = np.empty(dims, np.float32)
        rows, flat = out.reshape(-1, dims[-1]), raw.reshape(-1, raw.shape[-1])
        step = max(1, _DEQUANT_VALUES // dims[-1])
        for start in range(0, rows.shape[0], step):
            rows[start:start + step] = gguf_package.quants.dequantize(flat[start:start + step], tensor.tensor_type)
        return out

    def read(self, name: str) -> "torch.Tensor":
        """transformers' tensor ``name``: dequantized (float32) and processed as its GGUF loader does."""
        import torch

        if name not in self._infos:
            raise KeyError(f"{self.path}: no tensor {name}")
        parsed = {"tensors": {}}
        out = None
        for gguf_name in self._sources[name]:
            tensor = self._tensors[gguf_name]
            raw = self._raw(tensor)
            weights = self._dequantized(raw, tensor)
            result = self._processor.process(weights=weights, name=gguf_name, tensor_key_mapping=self._mapping,
                                             parsed_parameters=parsed)
            if result.name is not None and self._mapping.get(result.name) == name:
                weights = result.weights
                # as transformers: np.copy -> from_numpy -> float32; ``raw`` is this call's own buffer, so a
                # contiguous view of it (an F32 tensor) is handed over as it is rather than copied again
                fresh = weights.flags.c_contiguous and weights.flags.writeable
                out = torch.from_numpy(weights if fresh else np.copy(weights)).to(torch.float32)
        if out is None:
            out = parsed["tensors"][name].to(torch.float32)
        return out

    def blocks(self, name: str) -> Blocks | None:
        """``name``'s Q4_0/Q8_0 blocks in MatMulNBits' layout, in transformers' row order; None for any other
        type, or when transformers' processing of it is more than a reordering of its rows."""
        sources = self._sources.get(name) or []
        if len(sources) != 1 or name not in self._infos:
            return None
        tensor = self._tensors[sources[0]]
        bits = CARRIED.get(tensor.tensor_type.name)
        shape = self._infos[name].shape
        if bits is None or len(shape) != 2 or shape[1] % BLOCK:
            return None
        order = self._row_order(sources[0], name, shape[0])
        if order is None:
            return None
        raw = self._raw(tensor)  # [N, K // 32 * block bytes]
        rows, per_row = shape[0], shape[1] // BLOCK
        blocks = raw.reshape(rows, per_row, -1)
        data = np.empty((rows, per_row, BLOCK * bits // 8), np.uint8)
        scales = np.empty((rows, per_row), np.float32)
        for start in range(0, rows, _ROWS):
            take = order[start:start + _ROWS]
            chunk = blocks[take]
            scales[start:start + len(take)] = chunk[..., :2].copy().view(np.float16)[..., 0]
            q = chunk[..., 2:]
            if bits == 8:  # int8 q -> uint8 q + 128 (MatMulNBits' default zero point at 8 bits)
                data[start:start + len(take)] = q ^ np.uint8(0x80)
            else:  # GGUF: byte j = element j (low nibble), j + 16 (high); ORT: byte i = 2i (low), 2i + 1 (high)
                values = np.concatenate([q & np.uint8(0x0F), q >> np.uint8(4)], axis=-1)
                data[start:start + len(take)] = values[..., 0::2] | (values[..., 1::2] << np.uint8(4))
        return Blocks(bits, BLOCK, data, scales, None)

    def _row_order(self, gguf_name: str, name: str, rows: int) -> np.ndarray | None:
        """The row order transformers' processor puts ``gguf_name``'s rows in (row numbers passed through it;
        a second column, offset by a half, catches a processor that moves values between columns)."""
        probe = np.repeat(np.arange(rows, dtype=np.float64)[:, None], 2, axis=1)
        probe[:, 1] += 0.5
        try:
            result = self._processor.process(weights=probe, name=gguf_name, tensor_key_mapping=self._mapping,
                                             parsed_parameters={"tensors": {}})
        except Exception:
            return None
        if result.name is None or self._mapping.get(result.name) != name:
            return None
        got = np.asarray(result.weights)
        if got.shape != (rows, 2) or not np.array_equal(got[:, 1] - got[:, 0], np.full(rows, 0.5)):
            return None
        order = got[:, 0]
        if not np.array_equal(np.sort(order), np.arange(rows, dtype=np.float64)):
            return None
        return order.astype(np.int64)

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None
        self._reader = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:  # at interpreter exit module globals may already be gone
            self.close()
        except Exception:
            pass
