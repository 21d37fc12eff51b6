"""The served models, one registry for every API: which model a request means, and whether it may queue.

Encoders (:class:`~attnx.runtime.serving.encoder.EncoderModel`) and text generators
(:class:`~attnx.runtime.serving.generation.GenerationModel`) alike, each a
:class:`~attnx.runtime.serving.model.ServedModel`, so every route, probe and gauge sees them all. Each states its
capabilities; :meth:`ModelRegistry.resolve` is every route's lookup: the model a path or a JSON request names (or,
named by none, the only one that can do what it asks), refused in one wording (404 an unknown name, 400 a model
that cannot); :meth:`ModelRegistry.get` is the probes' and descriptions', for any capability.

Admission: a request is let in by these rules, in this order, each refusing before the work it would waste.

1. Requests (:meth:`attnx.runtime.wire.envelope.Envelope.admitted`, KServe ``infer`` over HTTP and gRPC): while a
   model's queue plus the requests let in whose body is not queued yet fill ``max_queue``, a new one is
   ``overloaded`` before a byte of its body is read. The JSON routes are admitted by the next rules, once parsed.
2. Parts (:func:`check_queue_room`: an encoder's texts, KServe's and every embedding and scoring API's): a request
   whose parts are more than the queue ever holds is ``too_large`` (no retry helps), more than it holds now
   ``overloaded``, before any is tokenised. Generations (:func:`~attnx.runtime.serving.generation.check_choices`:
   prompts x ``n``) follow the same two rules and, on purpose, one of their own: at most ``MAX_CHOICES`` a request
   (``bad_input`` on ``n``).
3. Work (:mod:`attnx.runtime.core.pacing`, encoders only): parts that cannot all start before their queue deadline
   at the rates the model has shown are ``too_large``, or ``overloaded`` behind the work queued ahead. A generator
   has no such check; what a request may ask of it is bounded by its positions instead
   (:func:`~attnx.runtime.serving.generation.check_max_tokens`: a ``max_tokens`` the prompt leaves no room for).
4. The queue itself: the batcher (``QueueFullError``) and the scheduler (``SchedulerFull``) refuse what still finds
   it full when submitted (another request got there first), ``overloaded`` by their kind.
"""

from __future__ import annotations

from typing import Any

from attnx.runtime.serving.model import RERANK, SCORE, WORDS, ServedModel
from attnx.runtime.wire.errors import bad_input, not_found, overloaded, too_large


def check_queue_room(model: ServedModel, count: int) -> None:
    """Refuse, before any work, ``count`` parts the model's queue cannot take: more than it ever holds is
    ``too_large`` (a retry never helps), more than it holds now is ``overloaded`` (admission rule 2)."""
    if count > model.max_queue:
        raise too_large(f"{count} inputs, but model {model.name!r} queues at most {model.max_queue} at once: "
                        f"send at most {model.max_queue} per request")
    if model.queue_depth + count > model.max_queue:
        raise overloaded(f"model {model.name!r}: queue full ({model.max_queue} inputs waiting at most); "
                         f"retry later")


class ModelRegistry:
    """Every served model by name (each has one version, "1"), encoders and generators alike."""

    def __init__(self) -> None:
        self.models: dict[str, ServedModel] = {}

    def add(self, model: ServedModel) -> None:
        if model.name in self.models:
            raise ValueError(f"two models named {model.name!r} (use name=path to rename one)")
        self.models[model.name] = model

    def get(self, name: str, version: str | None = None, *, private: bool = False) -> ServedModel:
        """The model of a path (``/v2/models/{name}``); 404 otherwise. ``private``: the refusal does not list
        the served names (an open route, such as a readiness probe, answers clients without the key)."""
        model = self.models.get(name)
        if model is None:
            names = "" if private else f"; this server has {sorted(self.models)}"
            raise not_found(f"unknown model {name!r}{names}")
        if version not in (None, "", model.version):
            raise not_found(f"model {name!r} has no version {version!r} (versions: [{model.version!r}])")
        return model

    def able(self, capability: str) -> list[ServedModel]:
        return [m for m in self.models.values() if capability in m.capabilities]

    def resolve(self, name: object, capability: str, version: str | None = None, *,
                path: bool = False) -> Any:
        """The model a request for ``capability`` runs on: the one its path names (``path``: with ``version``;
        unknown is :meth:`get`'s 404) or its JSON ``model`` names, or with no name the server's only one that can
        do ``capability`` (for a classifier, its only one with several labels when it serves rerankers too); a
        named model that cannot is a 400 in its own words (:meth:`ServedModel.unfit`).

        Typed ``Any`` on purpose: the route asked for a capability only one kind of model has, and reads that
        kind's own members (an encoder's batcher, a generator's decoder)."""
        if path:
            model = self.get(str(name), version)
        elif name is None or name == "":
            return self._only(capability)
        else:
            found = self.models.get(str(name))
            if found is None:
                raise not_found(f"The model {name!r} does not exist on this server; its {WORDS[capability][1]} are "
                                f"{[m.name for m in self.able(capability)]}")
            model = found
        if capability not in model.capabilities:
            raise bad_input(model.unfit(capability), "model")
        return model

    def _only(self, capability: str) -> ServedModel:
        one, several, needs = WORDS[capability]
        fit = self.able(capability)
        if capability == SCORE and len(fit) > 1:  # a reranker predicts too; naming none means the classifier
            fit = [m for m in fit if RERANK not in m.capabilities] or fit
        if len(fit) == 1:
            return fit[0]
        names = [m.name for m in fit]
        raise bad_input(f"this server has several {several} {names}: name one in 'model'" if names
                        else f"this server has no {one} ({needs})", "model")

    @property
    def ready(self) -> bool:
        return all(m.ready for m in self.models.values())

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        for m in self.models.values():
            m.close(drain=drain, timeout=timeout)
