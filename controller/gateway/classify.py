"""What the policy keys a request by: its workload class and its model.

One home for both (:class:`RequestKeys`), because both become context keys, metric
labels and saved policy state: a value a client makes up must never become one. The
class comes from, in this order, the ``X-Workload-Class`` header, the OpenAI body's
``metadata.workload_class``, else the :class:`Classifier`; whatever names it, it is one
of the configured classes, else the default class. A model is one the pools serve (or
none: the default model); any other is refused with 404, as vLLM refuses it, before the
policy sees it. So memory and saved state stay flat whatever values clients send.

The scikit-learn classifier in ``policies`` fits the :class:`Classifier` protocol through
a small adapter (:class:`ModelClassifier`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

WORKLOAD_CLASS_HEADER = b"x-workload-class"
METADATA_CLASS_FIELD = "workload_class"
DEFAULT_CLASS = "default"
_CLASS_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
"""Without configured classes (a bare ``specpilot gateway``): what a named class may look
like to be taken as it is (the label rule of ``policies.classifier``)."""
_REPORT_EVERY_S = 60.0
BUILTIN_CLASSIFIER = "builtin"
"""``gateway.classifier``'s name for the shipped model (``policies.classifier``)."""

logger = logging.getLogger(__name__)


class Classifier(Protocol):
    """(request headers with lower-case names, parsed JSON body) → class name.

    Runs on the request path in the event loop: it should take well under a
    millisecond. A ``ValueError`` says the request is malformed (the default class, no
    log); any other exception is a bug (the default class, logged at most once a minute).
    """

    def __call__(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str: ...


class ConstantClassifier:
    """Every request in one class: the default until a trained classifier is plugged in."""

    def __init__(self, workload_class: str = DEFAULT_CLASS) -> None:
        self.workload_class = workload_class

    def __call__(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        return self.workload_class


class ModelClassifier:
    """The scikit-learn classifier (``policies.classifier``) as a :class:`Classifier`:
    the predicted class. Named classes and the clamp to the settings' classes are
    :class:`RequestKeys`' (the one place for both)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        from policies.classifier import prompt_text, request_temperature

        prediction = self.model.predict(prompt_text(body), request_temperature(body))
        return str(prediction.workload_class)


class UnknownModel(LookupError):
    """A request named a model no pool serves."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


class RequestKeys:
    """Resolves a request's workload class and model within the configured sets.

    ``classes`` None (a gateway without settings) takes a named class as it is when it
    looks like a label, without bounding how many there are; ``models`` None lets every
    model through. With both given, at most ``len(classes)`` classes and
    ``len(models) + 1`` models (one being "none named") ever reach the policy.

    Also a :class:`Classifier` itself (``__call__``), so it goes wherever one goes.
    """

    def __init__(
        self,
        classes: Iterable[str] | None = None,
        default_class: str | None = None,
        classifier: Classifier | None = None,
        *,
        models: Iterable[str] | None = None,
    ) -> None:
        listed = tuple(classes) if classes is not None else None
        self.default_class = default_class or (listed[0] if listed else DEFAULT_CLASS)
        if listed is not None and self.default_class not in listed:
            raise ValueError(f"default class {self.default_class!r} is not one of {listed}")
        self.classes = frozenset(listed) if listed is not None else None
        # Exact names first, then trimmed and lower-cased ones (how clients write them).
        self._names: dict[str, str] | None = None
        if listed is not None:
            self._names = {name.strip().lower(): name for name in listed}
            self._names.update({name: name for name in listed})
        self.classifier = classifier
        constant = (
            classifier.workload_class
            if type(classifier) is ConstantClassifier
            else (self.default_class if classifier is None else None)
        )
        # Resolved once: it is what every unlabelled request gets, on the request path.
        self._constant = self.named(constant) if constant is not None else None
        self.models = frozenset(models) if models is not None else None
        self._failures = 0
        self._reported_at: float | None = None

    def named(self, value: str) -> str:
        """The configured class a client's value names, else the default class."""
        names = self._names
        if names is None:
            normal = value.strip().lower()
            return normal if _CLASS_NAME.fullmatch(normal) else self.default_class
        found = names.get(value)
        if found is None:
            found = names.get(value.strip().lower())
        return found if found is not None else self.default_class

    def workload_class(self, header: str | None, body: Mapping[str, Any], raw: Any = None) -> str:
        """The class of a request whose ``X-Workload-Class`` header is ``header`` (None:
        absent). ``raw`` is the request's header pairs for the classifier (decoded only
        when one runs): a list of (bytes, bytes), or a mapping of str to str."""
        if header is not None and header.strip():
            return self.named(header)
        metadata = body.get("metadata")
        if isinstance(metadata, Mapping):
            value = metadata.get(METADATA_CLASS_FIELD)
            if isinstance(value, str) and value.strip():
                return self.named(value)
        # Anything else in metadata (not an object, a number) names nothing: the
        # classifier decides, as for a request without it.
        if self._constant is not None:
            return self._constant
        assert self.classifier is not None
        try:
            if raw is None or isinstance(raw, Mapping):
                headers = dict(raw or {})
            else:
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
            predicted = self.classifier(headers, body)
        except ValueError:
            return self.default_class  # a malformed request: not the gateway's problem
        except Exception as exc:
            self._report(exc)
            return self.default_class
        return self.named(predicted) if isinstance(predicted, str) else self.default_class

    def model(self, body: Mapping[str, Any]) -> str | None:
        """The request's model as the policy keys it: None when it names none (the
        default model) or names it with a non-string (the upstream answers that one);
        raises :class:`UnknownModel` for a name no pool serves."""
        model = body.get("model")
        if not isinstance(model, str):
            return None
        models = self.models
        if models is not None and model not in models:
            raise UnknownModel(model)
        return model

    def __call__(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        header = next(
            (v for k, v in headers.items() if k.lower() == WORKLOAD_CLASS_HEADER.decode()), None
        )
        return self.workload_class(header, body, headers)

    def _report(self, exc: Exception) -> None:
        """A classifier bug: logged with its traceback, at most once a minute."""
        self._failures += 1
        now = time.monotonic()
        if self._reported_at is not None and now - self._reported_at < _REPORT_EVERY_S:
            return
        logger.warning(
            "classifier failed (%d time(s) since the last report); using the default class %r",
            self._failures,
            self.default_class,
            exc_info=exc,
        )
        self._failures, self._reported_at = 0, now
