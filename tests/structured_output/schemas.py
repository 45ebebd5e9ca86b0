"""JSON schemas for the structured-output suite (imported by name: every test folder has its
own conftest): nested objects, bounded arrays, enums, const, bounded numbers, required and
optional fields, anyOf, $ref/$defs and patterns."""

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
    {"type": "object", "properties": {"v": {"type": "null"}}, "required": ["v"]},
    {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}},
        "required": ["age"],
    },
    {
        "type": "object",
        "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["p"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "object", "properties": {"kind": {"const": "point"}}, "required": ["kind"]},
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                },
                "required": ["name", "tags"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "required": ["id"],
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "boolean"}]},
    {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
            }
        },
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}
        },
        "required": ["items"],
    },
    {
        "$defs": {"name": {"type": "string", "maxLength": 8}},
        "type": "object",
        "properties": {"first": {"$ref": "#/$defs/name"}, "last": {"$ref": "#/$defs/name"}},
        "required": ["first", "last"],
    },
    {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
        "required": ["code"],
    },
    {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["word"],
    },
    {"type": "string", "enum": ["alpha", "beta"]},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "boolean"},
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "error"]},
            "detail": {"type": "string", "maxLength": 10},
            "count": {"type": "integer", "minimum": 0},
        },
        "required": ["status", "count"],
    },
    {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"r": {"type": "number"}},
                        "required": ["r"],
                    },
                    {
                        "type": "object",
                        "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}},
                        "required": ["w", "h"],
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    {"type": "object", "properties": {}, "additionalProperties": False},
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "nick": {"type": ["string", "null"]}},
        "required": ["name", "nick"],
    },
]
