"""``StructuredOutputs``: what shape a request's output must take (one constraint per request)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from engine.errors import InvalidRequestError, wrong_type

MAX_CHOICES = 1024  # a choice list longer than this is refused (each one is a grammar branch)
FIELD = "structured_outputs"  # the request field errors name


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint on the generated text.

    - ``json_schema``: the JSON text of a JSON Schema; the output is one JSON value valid
      under it (``"strict"`` semantics: no properties beyond those the schema allows).
    - ``json_object``: any JSON object.
    - ``regex``: the output matches the regular expression in full (Rust ``regex`` syntax:
      no lookaround or backreferences).
    - ``grammar``: a context-free grammar in llguidance's Lark syntax (a ``start`` rule; GBNF
      written in Lark form, e.g. ``start: "yes" | "no"``); also accepts ``%llguidance {}``
      headers. See docs/structured-outputs.md.
    - ``choice``: the output is exactly one of these strings.

    The output ends (finish reason ``stop``) when the constraint is complete and nothing more
    can follow; EOS is allowed only where the text so far is complete.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):  # JSON gives lists; keep the params hashable
            object.__setattr__(self, "choice", tuple(self.choice))
        self._check_types()
        named = [f.name for f in fields(self) if _is_set(getattr(self, f.name))]
        if len(named) != 1:
            given = ", ".join(named) if named else "none"
            raise InvalidRequestError(
                FIELD,
                "set exactly one of json_schema, json_object, regex, grammar, choice "
                f"(given: {given})",
            )
        self._check_values()

    def _check_types(self) -> None:
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise wrong_type(f"{FIELD}.{name}", "a string or null", value)
        if not isinstance(self.json_object, bool):
            raise wrong_type(f"{FIELD}.json_object", "true or false", self.json_object)
        if self.choice is not None and (
            not isinstance(self.choice, tuple) or not all(isinstance(c, str) for c in self.choice)
        ):
            raise wrong_type(f"{FIELD}.choice", "a list of strings", self.choice)

    def _check_values(self) -> None:
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"{FIELD}.json_schema", f"is not valid JSON text: {exc}"
                ) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(
                    f"{FIELD}.json_schema", "must be a JSON object (or true/false), a JSON Schema"
                )
        for name in ("regex", "grammar", "json_schema"):
            if getattr(self, name) == "":
                raise InvalidRequestError(f"{FIELD}.{name}", "must not be empty")
        if self.choice is not None:
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise InvalidRequestError(
                    f"{FIELD}.choice", f"must hold 1 to {MAX_CHOICES} strings"
                )
            if not all(self.choice):
                raise InvalidRequestError(f"{FIELD}.choice", "must be non-empty strings")

    @classmethod
    def from_dict(cls, obj: object) -> StructuredOutputs:
        """From JSON (a batch line, an arq job): an object with exactly one known field."""
        if not isinstance(obj, dict):
            raise wrong_type(FIELD, "an object", obj)
        unknown = sorted(obj.keys() - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidRequestError(
                FIELD,
                f"unknown field {unknown[0]!r} (known: json_schema, json_object, regex, "
                "grammar, choice)",
            )
        schema = obj.get("json_schema")
        if isinstance(schema, (dict, bool)):  # a schema given as JSON rather than its text
            obj = {**obj, "json_schema": json.dumps(schema)}
        return cls(**obj)

    @property
    def kind(self) -> str:
        """The name of the field that is set (``json_schema``, ``regex``, ...)."""
        return next(f.name for f in fields(self) if _is_set(getattr(self, f.name)))

    @property
    def cache_key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: the kind and its text."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "choice":
            return kind, json.dumps(list(value))
        return kind, "" if kind == "json_object" else value


def _is_set(value: object) -> bool:
    return value is not None and value is not False
