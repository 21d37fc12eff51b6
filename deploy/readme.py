"""The README.md at the root of a repository written by ``attnx triton-repo``: how to run what is there.

It is rewritten from the repository's contents each time a model is added, so it describes every
model folder attnx wrote, not only the last one.
"""

from __future__ import annotations

import re
from pathlib import Path

TITLE = "# Triton model repository (written by `attnx triton-repo`)"


def _models(repo: Path) -> dict[str, str]:
    """``{model name: platform or backend}`` of the model folders attnx wrote in ``repo``."""
    found = {}
    for config in sorted(repo.glob("*/config.pbtxt")):
        body = config.read_text(errors="replace")
        if not body.startswith("# Written by attnx triton-repo"):
            continue
        kind = re.search(r'^(?:platform|backend):\s*"([^"]+)"', body, re.M)
        found[config.parent.name] = kind.group(1) if kind else "?"
    return found


def _first_output(config: Path) -> str:
    """The first output's name in a config.pbtxt that attnx wrote."""
    found = re.search(r'^output \[\s*\{\s*name: "([^"]+)"', config.read_text(errors="replace"), re.M)
    return found.group(1) if found else "output"


def _text_section(repo: Path, ensembles: list[str]) -> str:
    if not ensembles:
        return ""
    example = ensembles[0]
    return f"""
## Text models: call the ensemble with strings

{", ".join(f"`{e}`" for e in ensembles)} take a `text` input (`BYTES`, one string per row) and return the
model's outputs; a per-token output comes with `attention_mask` so the padded positions can be
dropped. Each is an ensemble of `<name>_tokenizer` (Python backend, the export's tokenizer with its
maximum length, truncation side and pad id) and `<name>_model` (token ids in; call it directly to
send ids). The Python backend needs the `tokenizers` package, which Triton's image lacks: build the
image from the `Dockerfile` here and run that image instead of the stock one.

```
docker build --build-arg TRITON_IMAGE=nvcr.io/nvidia/tritonserver:<release>-py3 -t attnx-triton .
docker run --rm -p 8000:8000 -p 8001:8001 -v $PWD:/models attnx-triton \\
    tritonserver --model-repository=/models
```

```python
import numpy as np, tritonclient.http as http
client = http.InferenceServerClient("localhost:8000")
text = http.InferInput("text", [2, 1], "BYTES")
text.set_data_from_numpy(np.array([[b"first sentence"], [b"second one"]], dtype=object))
result = client.infer("{example}", [text])
print(result.as_numpy({_first_output(repo / example / "config.pbtxt")!r}))
```

Each request is padded to its longest text rounded up to a bucket (`pad_to_multiple_of` in the
tokenizer's config.pbtxt), because Triton's dynamic batcher only merges requests of equal shape.
"""


def repository_readme(repo: Path) -> str:
    models = _models(repo)
    ensembles = [n for n, kind in models.items() if kind == "ensemble"]
    plans = [n for n, kind in models.items() if kind == "tensorrt_plan"]
    plugins = sorted(str(p.relative_to(repo)) for n in plans for p in (repo / n / "plugins").glob("*.so*"))
    plugin = plugins[0] if plugins else "<model>/plugins/libattnx_plugins.so"
    plugin_list = ("\n".join(f"- `{p}`" for p in plugins) if plugins else
                   "- none shipped (no library was given or found: build it with `attnx plugins build`, then run "
                   "`attnx triton-repo ... --plugin PATH` again)")
    kserve = (repo / "kserve.yaml").is_file()
    listing = "\n".join(f"| `{n}` | {kind} |" for n, kind in models.items())
    return f"""{TITLE}

| model | platform / backend |
|---|---|
{listing}

Each model folder has a `config.pbtxt` (checked against Triton's own ModelConfig schema when it was
written; ensembles also against the models they compose) and a version folder `1/`.

## Start Triton on it

```
tritonserver --model-repository=$PWD
```

ONNX models (`onnxruntime_onnx`) need no plugin: every attnx custom op carries a model-local
function that ONNX Runtime inlines. The files use opset 23, so Triton's ONNX Runtime must be 1.22
or newer.
{_text_section(repo, ensembles)}
## TensorRT engines

Engines (`tensorrt_plan`) need the attnx plugin library loaded into Triton, and the engine and the
library must come from the TensorRT version of Triton's TensorRT backend (an engine built with
TensorRT for RTX does not load there). Either:

```
tritonserver --model-repository=$PWD --backend-config=tensorrt,plugins="$PWD/{plugin}"
# or
LD_PRELOAD=$PWD/{plugin}:$LD_PRELOAD tritonserver --model-repository=$PWD
```

Plugin libraries here (inside their model's folder, where Triton ignores them):
{plugin_list}

## Variable-length requests: Triton does not pad

Triton's dynamic batcher concatenates requests only when their shapes match (apart from the batch
dim), so token-id requests of different lengths run in separate batches. To batch them, pad on the
client: pad every sequence to a common length (or a few buckets) and send `attention_mask` with 0
on the padded positions; the padded rows of a per-token output carry no meaning. (`attnx serve`
pads in the server; the text ensembles above pad in their tokenizer.)
{_kserve_section() if kserve else ""}"""


def _kserve_section() -> str:
    return """
## Kubernetes (KServe)

`kserve.yaml` is an `InferenceService` for this repository (KServe's Triton runtime, Open
Inference Protocol v2), checked against the kserve package's own types when it was written. Copy
the repository to the storage URI it names, then `kubectl apply -f kserve.yaml`.
"""
