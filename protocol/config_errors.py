"""pydantic's validation errors of the run config, said in one line that names the key.

pydantic reports where (a location tuple) and what (an error type); a user of the run TOML wants
``train.steps must be positive, got 0`` or ``unknown key 'train.stesp' (did you mean
'train.steps'?)``. Ranges are read back from the field's own constraints so the message says the
whole allowed range, not the one bound that failed.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

_TYPE_WORDS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "finite_number": "a finite number",
}
_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def describe(err: ValidationError, root: type[BaseModel]) -> str:
    """The first error of ``err`` (validating ``root``) as one line; the others are counted."""
    errors = err.errors(include_url=False)
    text = _describe_one(errors[0], root)
    if len(errors) > 1:
        more = len(errors) - 1
        text += f" (and {more} more error{'s' if more > 1 else ''})"
    return text


def _describe_one(error: ErrorDetails, root: type[BaseModel]) -> str:
    loc = tuple(str(part) for part in error["loc"])
    ctx = error.get("ctx") or {}
    if "config_key" in ctx:  # a check across keys of a table names the key it is about
        loc += (str(ctx["config_key"]),)
    key = ".".join(loc)
    kind, value = error["type"], _toml(error["input"])
    if kind == "extra_forbidden":
        return _unknown_key(loc, root)
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"[{key}] must be a table, got {value}" if key else f"the run config must be a table, got {value}"
    if kind in _TYPE_WORDS:
        return f"{key} must be {_TYPE_WORDS[kind]}, got {value}"
    if kind == "literal_error":
        return f"{key} = {value} is not one of {ctx.get('expected', '')}"
    if kind in _BOUND_ERRORS:
        field = _field(loc, root)
        extra: Any = (field.json_schema_extra or {}) if field is not None else {}
        # A sanity cap (runconfig's ``_bounded``) is named only to a value above it: a 0 is told
        # that it must be positive, not that it must be within (0, 1000000000].
        low_failed = extra.get("cap") and kind in ("greater_than", "greater_than_equal")
        if field is None:
            allowed = error["msg"].replace("Input should ", "", 1)
        else:
            allowed = _range(field, lower_only=bool(low_failed))
        why = None if low_failed else extra.get("why")
        return f"{key} must {allowed}, got {value}" + (f" ({why})" if why else "")
    if kind == "cross_field":
        return f"{key} {error['msg']}"
    return f"{key}: {error['msg']}"


def _toml(value: Any) -> str:
    """A value as the TOML file spells it (``true``, not ``True``)."""
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def _unknown_key(loc: tuple[str, ...], root: type[BaseModel]) -> str:
    *parents, name = loc
    where = ".".join(loc)
    section = _section(tuple(parents), root)
    known = sorted(section.model_fields) if section is not None else []
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"unknown key '{where}' (did you mean '{'.'.join([*parents, close[0]])}'?)"
    return f"unknown key '{where}' (known here: {', '.join(known)})"


def _section(path: tuple[str, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    model: Any = root
    for part in path:
        field = model.model_fields.get(part)
        if field is None:
            return None
        # An optional table (``pipeline: PipelineSection | None``) is the table it may be.
        options = typing.get_args(field.annotation) or (field.annotation,)
        tables = [t for t in options if isinstance(t, type) and issubclass(t, BaseModel)]
        if not tables:
            return None
        model = tables[0]
    return model


def _field(loc: tuple[str, ...], root: type[BaseModel]) -> FieldInfo | None:
    section = _section(loc[:-1], root)
    return section.model_fields.get(loc[-1]) if section is not None and loc else None


def _range(field: FieldInfo, lower_only: bool = False) -> str:
    """What a field's ``Field(gt=..., le=...)`` constraints allow, in words (after "must");
    ``lower_only``: its lower bound alone."""
    names = ("gt", "ge") if lower_only else ("gt", "ge", "lt", "le")
    bounds = {name: getattr(item, name) for item in field.metadata for name in names if hasattr(item, name)}
    low, high = bounds.get("gt", bounds.get("ge")), bounds.get("lt", bounds.get("le"))
    if high is None:
        if low == 0:
            return "be positive" if "gt" in bounds else "not be negative"
        return f"be {'greater than' if 'gt' in bounds else 'at least'} {_num(low)}"
    if low is None:
        return f"be {'below' if 'lt' in bounds else 'at most'} {_num(high)}"
    return f"be within {'(' if 'gt' in bounds else '['}{_num(low)}, {_num(high)}{')' if 'lt' in bounds else ']'}"


def _num(bound: float) -> str:
    """A bound as a reader writes it: integers whole (1000000000, not 1e+09), others short."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"
