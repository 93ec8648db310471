//! JSON schemas for structured output's tests, on the CPU and the GPU alike.

use serde_json::{Value, json};

/// Schemas of every kind a client sends, each bounded so that the outputs it allows end
/// well within 200 tokens (strings and arrays by length, numbers as bounded integers: a
/// JSON number's digits have no bound).
pub fn schemas() -> Vec<Value> {
    let name = json!({"type": "string", "minLength": 1, "maxLength": 12});
    vec![
        json!({"type": "object", "properties": {"name": name, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
            "additionalProperties": false}),
        json!({"type": "object", "properties": {"tags": {"type": "array", "items": name, "minItems": 1, "maxItems": 3}},
            "required": ["tags"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -100, "maximum": 100}, "y": {"type": "integer", "minimum": -100, "maximum": 100}},
            "required": ["x", "y"], "additionalProperties": false}}, "required": ["point"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
            "required": ["code"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"],
            "additionalProperties": false}),
        json!({"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"],
            "additionalProperties": false}),
        json!({"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, name]}},
            "required": ["value"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99}, "minItems": 2, "maxItems": 4}),
        json!({"type": "object", "properties": {"title": name, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "genre": {"enum": ["drama", "comedy"]}}, "required": ["title", "year", "genre"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"a": name, "b": name}, "required": ["a"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": name, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": false}}}, "required": ["items"], "additionalProperties": false}),
        json!({"$defs": {"person": {"type": "object", "properties": {"name": name}, "required": ["name"],
            "additionalProperties": false}}, "type": "object", "properties": {"author": {"$ref": "#/$defs/person"},
            "editor": {"$ref": "#/$defs/person"}}, "required": ["author", "editor"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0, "maximum": 50}},
            "required": ["status", "count"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"percent": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["percent"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 10}}, "required": ["note"],
            "additionalProperties": false}),
        json!({"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 30}},
            "required": ["email"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"grid": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
            "required": ["grid"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8},
            "wild": {"type": "boolean"}}, "required": ["kind", "legs"], "additionalProperties": false}),
        json!({"type": "string", "enum": ["north", "south", "east", "west"]}),
        json!({"type": "object", "properties": {"when": {"type": "string", "format": "time"}}, "required": ["when"],
            "additionalProperties": false}),
    ]
}

pub fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::options().should_validate_formats(true).build(schema).expect("a valid schema")
}
