"""A strict cattrs converter, shared by the wire codec and the config loader.

cattrs is lenient by default (``int("5")``, a string structured into a tuple of characters,
extra keys ignored). Here a field of the wrong type or an unknown key is an error.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import Any

import cattrs
from cattrs.errors import IterableValidationError, IterableValidationNote


def _strict_scalar(expected: type | str, check: Callable[[Any], bool], convert: Callable[[Any], Any]) -> Any:
    name = expected if isinstance(expected, str) else expected.__name__

    def hook(value: Any, _type: Any) -> Any:
        if not check(value):
            raise TypeError(f"expected {name}, got {value!r}" if isinstance(value, float) else f"expected {name}, got {type(value).__name__}")
        return convert(value)

    return hook


def _is_homogeneous_tuple(tp: Any) -> bool:
    args = typing.get_args(tp)
    return typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis


def _is_typed_dict_mapping(tp: Any) -> bool:
    origin: Any = typing.get_origin(tp)
    return origin is dict and bool(typing.get_args(tp))


def make_strict_converter() -> cattrs.Converter:
    """Return a converter that forbids unknown keys and never coerces between JSON types."""
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(
        bool, _strict_scalar(bool, lambda v: isinstance(v, bool), bool)
    )
    converter.register_structure_hook(
        int,
        _strict_scalar(int, lambda v: isinstance(v, int) and not isinstance(v, bool), int),
    )
    converter.register_structure_hook(
        float,
        _strict_scalar(
            "a finite number",
            lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
            float,
        ),
    )
    converter.register_structure_hook(
        str, _strict_scalar(str, lambda v: isinstance(v, str), str)
    )

    def tuple_hook_factory(tp: Any) -> Callable[[Any, Any], Any]:
        (item_type, _) = typing.get_args(tp)
        structure_item = converter.get_structure_hook(item_type)

        def hook(value: Any, _type: Any) -> Any:
            if not isinstance(value, list | tuple):
                raise TypeError(f"expected a list, got {type(value).__name__}")
            items, errors = [], []
            for index, item in enumerate(value):
                try:
                    items.append(structure_item(item, item_type))
                except Exception as exc:  # noqa: BLE001 - collected and re-raised as one group
                    exc.__notes__ = [
                        *getattr(exc, "__notes__", []),
                        IterableValidationNote(f"Structuring {tp} @ index {index}", index, item_type),
                    ]
                    errors.append(exc)
            if errors:
                raise IterableValidationError(f"While structuring {tp!r}", errors, tp)
            return tuple(items)

        return hook

    converter.register_structure_hook_factory(_is_homogeneous_tuple, tuple_hook_factory)

    def dict_hook_factory(tp: Any) -> Callable[[Any, Any], Any]:
        key_type, value_type = typing.get_args(tp) or (Any, Any)
        structure_key = converter.get_structure_hook(key_type)
        structure_value = converter.get_structure_hook(value_type)

        def hook(value: Any, _type: Any) -> Any:
            if not isinstance(value, dict):
                raise TypeError(f"expected a mapping, got {type(value).__name__}")
            return {
                structure_key(k, key_type): structure_value(v, value_type)
                for k, v in value.items()
            }

        return hook

    converter.register_structure_hook_factory(_is_typed_dict_mapping, dict_hook_factory)
    return converter


def _format_exception(exc: BaseException, type_: Any) -> str:
    """cattrs' wording, plus the exception's own text when it adds something (an attrs
    validator's "'ttft' must be >= 0: -1" names the field cattrs cannot)."""
    text = cattrs.v.format_exception(exc, type_)
    # attrs validators pass (message, attribute, ...) as args: the message is the first.
    detail = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    if isinstance(exc, ValueError | TypeError) and detail and detail not in text:
        return f"{text}: {detail}"
    return text


def describe_error(exc: Exception, path: str = "$") -> str:
    """Turn a cattrs validation error into one readable line naming the offending keys."""
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, path=path, format_exception=_format_exception))
    return f"{exc} @ {path}"
