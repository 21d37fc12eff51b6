"""What the routes share (:class:`Serving`): the registry, the envelope every request goes through, the policies.

The HTTP app keeps it as ``app.state.serving`` (a route reads it with :func:`serving`), the gRPC services hold it;
the wire sees it only as what it closes at shutdown (:class:`attnx.runtime.wire.http.AppState`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

import attnx
from attnx.runtime.core.chat import Renderer
from attnx.runtime.serving.encoding import Dimensions
from attnx.runtime.serving.registry import ModelRegistry
from attnx.runtime.wire.envelope import Envelope
from attnx.runtime.wire.limits import Limits
from attnx.runtime.wire.metrics import ServerMetrics


@dataclass
class Serving:
    """What the routes share: the models, the envelope every request goes through, and the server's policies."""

    registry: ModelRegistry
    envelope: Envelope
    metrics: ServerMetrics
    limits: Limits
    chat: Renderer  # chat templates, in worker processes
    dimensions: Dimensions = field(default_factory=Dimensions)  # which models may be cut shorter
    extensions: list[str] = field(default_factory=list)
    #: JSON strings past this many characters are read as their two ends (the largest character cap of a model)
    string_cap: int | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    version: str = getattr(attnx, "__version__", "0")

    def close(self) -> None:
        """Once no request is in flight: the models drain and close, then the worker threads."""
        self.registry.close()
        self.envelope.workers.close()


def serving(request: Request) -> Serving:
    state: Serving = request.app.state.serving
    return state
