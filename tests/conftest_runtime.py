"""Helpers shared by the runtime/serving tests (imported by them; pytest does not load it by itself).

Models come from the real exporter through the ``exported`` fixture of
``tests/conftest.py`` (small config, cached for the whole session).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Mapping

import numpy as np

from attnx.deploy.loadtest import synthetic_feeds
from attnx.runtime.core.session import Session

#: One layer is enough to exercise masking and context inputs, and exports fastest.
EXPORT_KW = {"n_layers": 1}


def request(session: Session, rows: int, length: int, seed: int, *, pad_to: int | None = None,
            with_mask: bool = True) -> dict[str, np.ndarray]:
    """Random valid feeds: ``rows`` sequences of ``length`` tokens (optionally already padded to ``pad_to``)."""
    feeds = synthetic_feeds(session.inputs, rows, pad_to or length, np.random.default_rng(seed), length=length)
    if not with_mask:
        feeds.pop("attention_mask")
    return feeds


def assert_outputs_equal(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], atol: float = 1e-5) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name in want:
        g, w = np.asarray(got[name]), np.asarray(want[name])
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        if w.dtype.kind in "iub":
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=name)


class GatedSession(Session):
    """A real session whose runs wait until the test opens the gate.

    It lets a test hold the batcher's worker inside a run, so that queue limits,
    timeouts and draining can be driven deterministically. ``fail_next`` makes the
    next run raise that exception instead of running (a model failure).
    """

    def __init__(self, inner: Session):
        self.inner = inner
        self.path = inner.path
        self.inputs = inner.inputs
        self.outputs = inner.outputs
        self.metadata = inner.metadata
        self.provider = inner.provider
        self.platform = inner.platform
        self.gate = threading.Event()
        self.running = threading.Semaphore(0)  # released once per run entered
        self.runs = 0
        self.fail_next: Exception | None = None

    def _run(self, feeds, output_names):
        self.runs += 1
        self.running.release()
        if not self.gate.wait(60):
            raise RuntimeError("test gate never opened")
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        return self.inner._run(feeds, output_names)


@contextlib.contextmanager
def running_server(models, **kwargs) -> Iterator["InferenceServer"]:  # noqa: F821
    """An InferenceServer on a free loopback port in a background thread, always stopped. ``kwargs``: the serving
    config's fields or the layers' values (``batching=``, ``limits=``, ``http_limits=``), and what is per model."""
    from attnx.runtime.config import ServingConfig
    from attnx.runtime.server import InferenceServer

    beside = {k: kwargs.pop(k) for k in ("tokenizers", "axes", "dimensions", "on_warning") if k in kwargs}
    server = InferenceServer(models, ServingConfig.from_parts(host="127.0.0.1", port=0, **kwargs), **beside).start()
    try:
        yield server
    finally:
        server.stop(timeout=30)


def triton_infer(client, model: str, feeds: Mapping[str, np.ndarray], *, binary_in: bool = True,
                 binary_out: bool = True, outputs: list[str] | None = None, **kwargs):
    """One infer through the unmodified tritonclient.http; returns ({name: array}, response JSON).

    ``outputs=None`` with ``binary_out``: the client's default (every output, binary).
    JSON outputs are asked for by name (all of the model's when ``outputs`` is None).
    """
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, arr in feeds.items():
        item = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        item.set_data_from_numpy(arr, binary_data=binary_in)
        inputs.append(item)
    if outputs is None and not binary_out:
        outputs = [o["name"] for o in client.get_model_metadata(model)["outputs"]]
    requested = None
    if outputs is not None:
        requested = [httpclient.InferRequestedOutput(n, binary_data=binary_out) for n in outputs]
    result = client.infer(model, inputs, outputs=requested, **kwargs)
    response = result.get_response()
    return {o["name"]: result.as_numpy(o["name"]) for o in response["outputs"]}, response


def long_text(words: int, seed: int = 0) -> str:
    """Real English words (from the built-in sentences), ``words`` of them."""
    from attnx.pretrained.sentences import SENTENCES

    pool = " ".join(SENTENCES).split()
    rng = np.random.default_rng(seed)
    return " ".join(pool[int(i)] for i in rng.integers(len(pool), size=words))


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


class TokenizerSpy:
    """Stands in for a ``tokenizers.Tokenizer`` and records the length of every text it is asked to encode."""

    def __init__(self, inner, seen: list):
        self.inner, self.seen = inner, seen

    def encode_batch(self, inputs, **kwargs):
        self.seen += [len(x) if isinstance(x, str) else sum(map(len, x)) for x in inputs]
        return self.inner.encode_batch(inputs, **kwargs)

    def encode(self, text, **kwargs):
        self.seen.append(len(text))
        return self.inner.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def spy_on(tokenizer, monkeypatch) -> list:
    """The lengths of the texts ``tokenizer`` (a TextTokenizer) hands its Rust tokenizer from now on."""
    seen: list = []
    for attr in ("_full", "_cut"):
        monkeypatch.setattr(tokenizer, attr, TokenizerSpy(getattr(tokenizer, attr), seen))
    return seen
