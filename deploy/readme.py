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


def _tensor_names(config: Path, kind: str) -> list[str]:
    """The ``input`` or ``output`` names in a config.pbtxt that attnx wrote (top-level blocks only)."""
    body = config.read_text(errors="replace")
    block = re.search(rf"^{kind} \[\n(.*?)^\]", body, re.M | re.S)
    return re.findall(r'^    name: "([^"]+)"', block.group(1), re.M) if block else []


def _optional_inputs(config: Path) -> list[str]:
    body = config.read_text(errors="replace")
    block = re.search(r"^input \[\n(.*?)^\]", body, re.M | re.S)
    entries = re.split(r"^  \{", block.group(1), flags=re.M) if block else []
    return [m.group(1) for e in entries if "optional: true" in e and (m := re.search(r'name: "([^"]+)"', e))]


def _example(repo: Path, ensemble: str) -> str:
    """A tritonclient call of one text ensemble, as its config declares it (run as written by the tests)."""
    config = repo / ensemble / "config.pbtxt"
    outputs = _tensor_names(config, "output")
    shown = next((o for o in ("sentence_embedding", "logits") if o in outputs), outputs[0] if outputs else "output")
    pairs = "text_pair" in _tensor_names(config, "input")
    first = '[b"how do dogs play"], [b"how do dogs play"]' if pairs else '[b"first sentence"], [b"second one"]'
    lines = ["import numpy as np, tritonclient.http as http",
             'client = http.InferenceServerClient("localhost:8000")',
             'text = http.InferInput("text", [2, 1], "BYTES")',
             f"text.set_data_from_numpy(np.array([{first}], dtype=object))"]
    inputs = "[text]"
    if pairs:
        lines += ['pair = http.InferInput("text_pair", [2, 1], "BYTES")',
                  'pair.set_data_from_numpy(np.array([[b"Two dogs play in the snow."], [b"A man is eating food."]], '
                  'dtype=object))']
        inputs = "[text, pair]"
    lines += [f'result = client.infer("{ensemble}", {inputs})', f"print(result.as_numpy({shown!r}))"]
    context = [n for n in _optional_inputs(config) if n != "text_pair"]
    note = (f"\n`{ensemble}` also takes {', '.join(f'`{n}`' for n in context)} (one row per text); each may be left "
            "out, as here: the tokenizer step then fills the export's default for it, as `attnx serve` does.\n"
            if context else "")
    return f"""
```python
{chr(10).join(lines)}
```
{note}"""


def _text_section(repo: Path, ensembles: list[str]) -> str:
    if not ensembles:
        return ""
    return f"""
## Text models: call the ensemble with strings

{", ".join(f"`{e}`" for e in ensembles)} take a `text` input (`BYTES`, one string per row) and return the
model's outputs; a per-token output comes with `attention_mask` so the padded positions can be
dropped. A classifier also takes `text_pair`, each row's second text (a cross-encoder's document),
tokenised with `text` as a pair. Each is an ensemble of `<name>_tokenizer` (Python backend, the export's
tokenizer with its maximum length, truncation side and pad id) and `<name>_model` (token ids in; call
it directly to send ids). The Python backend needs the `tokenizers` package, which Triton's image
lacks: build the image from the `Dockerfile` here and run that image instead of the stock one.

```
docker build --build-arg TRITON_IMAGE=nvcr.io/nvidia/tritonserver:<release>-py3 -t attnx-triton .
docker run --rm -p 8000:8000 -p 8001:8001 -v $PWD:/models attnx-triton \\
    tritonserver --model-repository=/models
```
{"".join(_example(repo, e) for e in ensembles)}
Each request is padded to its longest text rounded up to a bucket (`pad_to_multiple_of` in the
tokenizer's config.pbtxt), because Triton's dynamic batcher only merges requests of equal shape.
"""


def _python_section(runtime_models: list[str]) -> str:
    if not runtime_models:
        return ""
    return f"""
## Models run by attnx's runtime (Python backend)

{", ".join(f"`{m}`" for m in runtime_models)} run on attnx's runtime inside Triton's Python backend
(`1/model.py`, written by `attnx triton-repo --backend python`; ONNX Runtime, or TensorRT for an
engine, under it): no ONNX Runtime backend is needed, attnx's custom ops run on the stub's ONNX Runtime,
and requests of different lengths share a batch (their sequence inputs are `allow_ragged_batch`:
attnx pads them, runs them once and cuts each answer back). Inputs marked `optional` are filled as
`attnx serve` fills them when a request leaves them out.

What the Python that runs Triton's Python-backend stub needs (the `Dockerfile` here installs it):

- `attnx` and `onnxruntime` (`onnxruntime-gpu` for `KIND_GPU` instances), `onnx`, and `tokenizers`
  for the text models; attnx's own dependencies beyond these (torch, for exporting) are not needed;
- numpy<2 with Triton's stub up to 2.51 at least: it reads numpy 2 arrays wrongly, and these models
  refuse to load on such a stub rather than answer wrongly;
- the stub built for that Python's version: Triton's image ships one for its own Python. Outside a
  container, copy the stub for your Python into `<backend directory>/python/` and start
  `tritonserver --backend-directory=...` with that Python environment's `bin/` first on `PATH`: the
  stub's embedded interpreter takes its packages from there.
"""


def repository_readme(repo: Path) -> str:
    models = _models(repo)
    ensembles = [n for n, kind in models.items() if kind == "ensemble"]
    runtime_models = [n for n, kind in models.items() if kind == "python"
                      and 'key: "model_file"' in (repo / n / "config.pbtxt").read_text(errors="replace")]
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
{_text_section(repo, ensembles)}{_python_section(runtime_models)}
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
