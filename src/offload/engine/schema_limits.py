"""The JSON schema keywords xgrammar parses but does not enforce: a grammar made from a
schema that uses one lets the model write output the schema rejects. `unenforced` finds
the first such use, so that a request is refused by name (as vLLM's xgrammar backend
refuses them) instead of answered with JSON that does not validate. Found by feeding
xgrammar 0.2's grammars a value each keyword forbids (tests/engine/test_schema_limits.py
keeps those probes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# Keywords that describe and do not constrain: harmless anywhere.
ANNOTATIONS = frozenset(
    {
        "$anchor",
        "$comment",
        "$defs",
        "$id",
        "$schema",
        "$vocabulary",
        "default",
        "definitions",
        "deprecated",
        "description",
        "discriminator",
        "examples",
        "readOnly",
        "title",
        "writeOnly",
    }
)  # fmt: skip  ("discriminator": OpenAPI's, as pydantic writes tagged unions)
# Parsed, then dropped: the output may break them.
NOT_ENFORCED = (
    "contains", "dependencies", "dependentRequired", "dependentSchemas", "else", "if",
    "maxContains", "minContains", "not", "then", "uniqueItems",
)  # fmt: skip
NUMBER_KEYWORDS = ("exclusiveMaximum", "exclusiveMinimum", "maximum", "minimum", "multipleOf")
STRING_KEYWORDS = ("format", "maxLength", "minLength", "pattern")
BRANCHING = ("$ref", "allOf", "anyOf", "oneOf")
# Where a schema holds schemas: keyword -> how (one, a list, or a map of them).
NESTED = {
    "additionalItems": "one", "additionalProperties": "one", "items": "one",
    "propertyNames": "one", "unevaluatedItems": "one", "unevaluatedProperties": "one",
    "allOf": "list", "anyOf": "list", "oneOf": "list", "prefixItems": "list",
    "$defs": "map", "definitions": "map", "patternProperties": "map", "properties": "map",
}  # fmt: skip
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
               dict: "object", type(None): "null"}  # fmt: skip


def unenforced(schema: Any) -> str | None:
    """Why xgrammar would not hold output to `schema` ("uniqueItems at
    /properties/tags"), or None where every constraint it uses is enforced."""
    for node, path in _nodes(schema, ""):
        found = _node_unenforced(node, schema)
        if found is not None:
            return f"{found} at {path or '/'}"
    return None


def _nodes(node: Any, path: str) -> Iterator[tuple[dict, str]]:
    """Every schema object within `node` (itself first) with its JSON pointer."""
    if not isinstance(node, dict):
        return
    yield node, path
    for key, how in NESTED.items():
        value = node.get(key)
        if how == "one":
            yield from _nodes(value, f"{path}/{key}")
        elif how == "list" and isinstance(value, list):
            for index, item in enumerate(value):
                yield from _nodes(item, f"{path}/{key}/{index}")
        elif how == "map" and isinstance(value, dict):
            for name, item in value.items():
                yield from _nodes(item, f"{path}/{key}/{name}")


def _node_unenforced(node: dict, root: dict) -> str | None:
    """What one schema object uses that xgrammar drops (its nested schemas aside)."""
    for key in NOT_ENFORCED:
        if key in node and not (key == "uniqueItems" and node[key] is False):
            return key
    types = _types(node)
    if "multipleOf" in node and not (types == {"integer"} and _whole(node["multipleOf"])):
        return "multipleOf (enforced only on integers, by a whole number)"
    branching = [key for key in BRANCHING if key in node]
    if branching:
        return _branching_unenforced(node, branching, types, root)
    for keys, kinds in ((NUMBER_KEYWORDS, {"integer", "number"}), (STRING_KEYWORDS, {"string"})):
        used = [key for key in keys if key in node]
        if used and not (types & kinds):
            return f"{used[0]} without a type of {' or '.join(sorted(kinds))}"
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        return "minLength/maxLength beside pattern or format (the lengths are dropped)"
    for key in ("enum", "const"):
        if key in node:
            return _choice_unenforced(node, key, types)
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    missing = [name for name in required if name not in properties]
    if missing:
        return f"required {missing[0]!r}, which properties does not define"
    return None


def _branching_unenforced(node: dict, branching: list[str], types: set[str], root: dict):
    """anyOf / oneOf / allOf / $ref: xgrammar takes one of them and drops the keywords
    beside it (a `type` that each branch's own type already implies aside)."""
    key = branching[0]
    if len(branching) > 1:
        return f"{key} beside {branching[1]}"
    listed = node[key] if isinstance(node[key], list) else []
    branches = [_resolved(branch, root) for branch in listed]
    if key == "allOf" and len(branches) > 1:
        return "allOf of more than one schema"
    beside = [k for k in node if k not in ANNOTATIONS and k != key]
    implied = key in ("anyOf", "oneOf") and all(
        isinstance(b, dict) and _types(b) and _types(b) <= types for b in branches
    )
    if beside and not (beside == ["type"] and implied):
        return f"{([k for k in beside if k != 'type'] or beside)[0]} beside {key}"
    if key == "oneOf" and not _disjoint(branches):
        return "oneOf whose branches may overlap (xgrammar takes it as anyOf)"
    return None


def _choice_unenforced(node: dict, key: str, types: set[str]) -> str | None:
    """enum / const: the values are the grammar; the keywords beside them are dropped."""
    beside = [k for k in node if k not in ANNOTATIONS and k not in (key, "type")]
    if beside:
        return f"{beside[0]} beside {key}"
    values = node[key] if key == "enum" and isinstance(node[key], list) else [node[key]]
    if "type" in node and not all(_type_of(v) & types for v in values):
        return f"{key} values outside its type"
    return None


def _resolved(node: Any, root: dict) -> Any:
    """`node`, or the schema its local `$ref` ("#/$defs/Name") points to, followed."""
    for _ in range(32):  # (a cycle of bare refs matches nothing: give up on it)
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#")):
            return node
        target: Any = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        node = target
    return node


def _disjoint(branches: list) -> bool:
    """Whether no value can match two of `branches`: their types differ, or each
    requires one property whose allowed constants differ (a tagged union)."""
    for i, one in enumerate(branches):
        for other in branches[i + 1 :]:
            if not (isinstance(one, dict) and isinstance(other, dict)):
                return False
            first, second = _types(one), _types(other)
            if first and second and not first & second:
                continue
            if not _tagged_apart(one, other):
                return False
    return True


def _tagged_apart(one: dict, other: dict) -> bool:
    """Both require a property whose const/enum values share nothing."""
    for name in set(one.get("required", ())) & set(other.get("required", ())):
        first, second = _constants(one, name), _constants(other, name)
        if first is not None and second is not None and not first & second:
            return True
    return False


def _constants(schema: dict, name: str) -> set[str] | None:
    """The values property `name` may take, as JSON text; None where not a fixed set."""
    prop = (schema.get("properties") or {}).get(name)
    if not isinstance(prop, dict):
        return None
    if "const" in prop:
        return {json.dumps(prop["const"], sort_keys=True)}
    if isinstance(prop.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in prop["enum"]}
    return None


def _types(node: dict) -> set[str]:
    """The JSON types `node` declares, or that xgrammar infers from its keywords (an
    object's, an array's); an integer is a number too; empty when none."""
    declared = node.get("type")
    names = {declared} if isinstance(declared, str) else set(declared or ())
    # (probed: "additionalProperties" or "patternProperties" alone make no object of it)
    for kind, keys in (("object", ("properties",)), ("array", ("items", "prefixItems"))):
        if not names and any(key in node for key in keys):
            names = {kind}
    if "number" in names:
        names.add("integer")
    return {n for n in names if isinstance(n, str)}


def _type_of(value: Any) -> set[str]:
    """The JSON types `value` has (a whole number is an integer and a number)."""
    name = _JSON_TYPES.get(type(value), "object")
    if name == "integer" or (name == "number" and float(value).is_integer()):
        return {"integer", "number"}
    return {name}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
