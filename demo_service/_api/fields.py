"""What the request models take, as strictly as their OpenAPI schema says: JSON's own types, no coercion.

pydantic's default (lax) mode would take ``false`` as the number 0, ``0`` as the boolean false and
``"2"`` as the integer 2, and so serve bodies the schema calls invalid. Request models derive from
:class:`StrictBody` instead, with the two allowances JSON Schema itself makes: a ``number`` may be
an integer (pydantic's strict float takes ints), and an ``integer`` may be written ``2.0``
(:data:`Integer`). :class:`Only` declares an OpenAI parameter this demo does not implement as its
neutral value(s) and refuses any other, from the same values, so schema and model cannot disagree.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError


def _integral(value: Any) -> Any:
    # Only an integral float is turned into an int; anything else goes on to the strict int check.
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: Lets a strict ``int`` take ``2.0``. Bounds go *before* it in ``Annotated[int, Field(ge=1), ...]``:
#: after it (or as a ``Field`` on a union around it) pydantic writes a raw ``ge`` into the schema,
#: not ``minimum``.
INTEGRAL_FLOATS = BeforeValidator(_integral)

#: A JSON Schema ``integer``: ``2`` or ``2.0``; never ``true``, ``2.5`` or ``"2"``.
Integer = Annotated[int, INTEGRAL_FLOATS]


def _same_json(value: Any, expected: Any) -> bool:
    """Equal as JSON values are: ``0 == 0.0``, but ``false`` is not ``0`` (Python says it is)."""
    return bool(value == expected) and isinstance(value, bool) == isinstance(expected, bool)


class Only:
    """``json_schema_extra`` for an OpenAI parameter this demo accepts only at its neutral value(s).

    The field's schema becomes ``{"enum": [...]}`` (``const: null`` would not survive FastAPI, which
    drops null members from the OpenAPI document), and :class:`StrictBody` refuses any other value
    with a 422 that names the field, so the declaration and the check cannot drift apart.
    """

    def __init__(self, *values: Any) -> None:
        self.values = values

    def __call__(self, schema: dict[str, Any]) -> None:
        for key in ("anyOf", "type", "additionalProperties", "items"):
            schema.pop(key, None)
        schema["enum"] = list(self.values)

    def allows(self, value: Any) -> bool:
        return any(_same_json(value, fine) for fine in self.values)

    def __repr__(self) -> str:
        return f"Only{self.values!r}"


class StrictBody(BaseModel):
    """A request body: JSON's types only, and :class:`Only` fields at their declared values.

    Nested bodies must derive from it too: a model's ``strict`` does not reach the models it holds.
    """

    model_config = ConfigDict(strict=True)

    @field_validator("*")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        only = cls.model_fields[info.field_name].json_schema_extra if info.field_name else None
        if isinstance(only, Only) and not only.allows(value):
            raise PydanticCustomError(
                "unsupported",
                "'{name}' is not supported by this server: only {allowed} (got {got})",
                {
                    "name": info.field_name,
                    "allowed": " or ".join(json.dumps(fine) for fine in only.values),
                    "got": json.dumps(value),
                },
            )
        return value
