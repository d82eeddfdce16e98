"""Which workload class a request belongs to.

The gateway reads the ``X-Workload-Class`` header itself (it always wins); otherwise it
asks a :class:`Classifier`. The scikit-learn classifier in ``policies`` fits through a
one-line adapter, e.g. ``lambda h, b: model.classify_request(h, b).workload_class``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

WORKLOAD_CLASS_HEADER = b"x-workload-class"
DEFAULT_CLASS = "default"


class Classifier(Protocol):
    """(request headers with lower-case names, parsed JSON body) → class name.

    Runs on the request path in the event loop: it should take well under a
    millisecond. An exception makes the gateway use its default class.
    """

    def __call__(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str: ...


class ConstantClassifier:
    """Every request in one class: the default until a trained classifier is plugged in."""

    def __init__(self, workload_class: str = DEFAULT_CLASS) -> None:
        self.workload_class = workload_class

    def __call__(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        return self.workload_class
