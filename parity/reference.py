"""The PyTorch reference of an attnx export, for every check (:func:`load_reference`).

A leaf of :mod:`attnx.parity`: the runners and the checks all rebuild the reference through it.
"""

from __future__ import annotations

import os

from attnx.contract import ContractError
from attnx.parity.cases import ParityError


def load_reference(path: str | os.PathLike, source: str | os.PathLike | None = None):
    """``(model with the export's weights, ModelInfo)`` for an attnx export
    (:func:`attnx.export.reference.load_reference`; ``source``: a pretrained export's source folder where it
    moved); set-up problems are :class:`ParityError` s."""
    from attnx.export.reference import load_reference as rebuild

    try:
        return rebuild(path, source)
    except ContractError as e:
        raise ParityError(str(e)) from None
