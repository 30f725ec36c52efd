//! Conversions between `google.protobuf.Struct` and `serde_json`, for the task specs, message
//! payloads and role state that travel as `Struct` on the wire and as JSON everywhere else.

use prost_types::value::Kind;
use serde_json::{Map, Value};

/// Converts a JSON object into a protobuf `Struct`.
pub fn object_to_struct(object: &Map<String, Value>) -> prost_types::Struct {
    prost_types::Struct {
        fields: object
            .iter()
            .map(|(key, value)| (key.clone(), to_value(value)))
            .collect(),
    }
}

/// Converts a JSON value into a protobuf `Struct`; a non-object becomes an empty struct.
pub fn to_struct(value: &Value) -> prost_types::Struct {
    match value {
        Value::Object(object) => object_to_struct(object),
        _ => prost_types::Struct::default(),
    }
}

/// Converts a JSON value into a protobuf `Value`. Numbers become doubles, as in protobuf's
/// JSON mapping.
pub fn to_value(value: &Value) -> prost_types::Value {
    let kind = match value {
        Value::Null => Kind::NullValue(0),
        Value::Bool(flag) => Kind::BoolValue(*flag),
        Value::Number(number) => Kind::NumberValue(number.as_f64().unwrap_or(0.0)),
        Value::String(text) => Kind::StringValue(text.clone()),
        Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(to_value).collect(),
        }),
        Value::Object(object) => Kind::StructValue(object_to_struct(object)),
    };
    prost_types::Value { kind: Some(kind) }
}

/// Converts a protobuf `Struct` into a JSON object.
pub fn struct_to_object(value: &prost_types::Struct) -> Map<String, Value> {
    value
        .fields
        .iter()
        .map(|(key, value)| (key.clone(), from_value(value)))
        .collect()
}

/// Converts a protobuf `Struct` into a JSON value (always an object).
pub fn from_struct(value: &prost_types::Struct) -> Value {
    Value::Object(struct_to_object(value))
}

/// Converts a protobuf `Value` into JSON. Whole doubles come back as integers, so ids and
/// counts that went through a `Struct` read as they were written.
pub fn from_value(value: &prost_types::Value) -> Value {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(flag)) => Value::Bool(*flag),
        Some(Kind::NumberValue(number)) => number_to_json(*number),
        Some(Kind::StringValue(text)) => Value::String(text.clone()),
        Some(Kind::ListValue(list)) => Value::Array(list.values.iter().map(from_value).collect()),
        Some(Kind::StructValue(object)) => from_struct(object),
    }
}

fn number_to_json(number: f64) -> Value {
    // 2^53: beyond it a double no longer holds every integer exactly.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    if number.fract() == 0.0 && number.abs() <= EXACT {
        // The cast is exact: the value is whole and within ±2^53.
        #[allow(clippy::cast_possible_truncation)]
        return Value::from(number as i64);
    }
    serde_json::Number::from_f64(number).map_or(Value::Null, Value::Number)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn json_survives_a_round_trip_through_struct() {
        let original = json!({
            "id": "IMPL-001", "attempts": 3, "ratio": 0.5, "ok": true, "none": null,
            "files": [{"path": "a.py", "action": "create"}], "nested": {"deep": [1, "two"]}
        });
        let back = from_struct(&to_struct(&original));
        assert_eq!(back, original);
    }

    #[test]
    fn a_non_object_becomes_an_empty_struct() {
        assert!(to_struct(&json!([1, 2])).fields.is_empty());
    }
}
