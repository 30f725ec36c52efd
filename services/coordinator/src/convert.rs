//! Conversions between JSON, protobuf well-known types and stored values.

use prost_types::value::Kind;
use serde_json::{Map, Number, Value};

/// Returns unix milliseconds as a protobuf timestamp.
pub(crate) fn timestamp(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
    }
}

/// Returns an optional unix-millisecond time as an optional timestamp.
pub(crate) fn opt_timestamp(ms: Option<i64>) -> Option<prost_types::Timestamp> {
    ms.map(timestamp)
}

/// Returns the current time in unix milliseconds.
pub(crate) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Returns unix milliseconds as RFC 3339 text (CCW's `_updated_at` format).
pub(crate) fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Converts a JSON object to a protobuf `Struct`.
pub(crate) fn json_to_struct(object: &Map<String, Value>) -> prost_types::Struct {
    prost_types::Struct {
        fields: object
            .iter()
            .map(|(key, value)| (key.clone(), json_to_value(value)))
            .collect(),
    }
}

fn json_to_value(value: &Value) -> prost_types::Value {
    let kind = match value {
        Value::Null => Kind::NullValue(0),
        Value::Bool(flag) => Kind::BoolValue(*flag),
        Value::Number(number) => Kind::NumberValue(number.as_f64().unwrap_or_default()),
        Value::String(text) => Kind::StringValue(text.clone()),
        Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(json_to_value).collect(),
        }),
        Value::Object(object) => Kind::StructValue(json_to_struct(object)),
    };
    prost_types::Value { kind: Some(kind) }
}

/// Converts a protobuf `Struct` to a JSON object. Whole numbers come back as integers.
pub(crate) fn struct_to_json(value: &prost_types::Struct) -> Map<String, Value> {
    value
        .fields
        .iter()
        .map(|(key, value)| (key.clone(), value_to_json(value)))
        .collect()
}

fn value_to_json(value: &prost_types::Value) -> Value {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(flag)) => Value::Bool(*flag),
        Some(Kind::NumberValue(number)) => {
            // Struct has only doubles; keep integers integral so JSON round-trips read naturally.
            if number.fract() == 0.0 && number.abs() < 9.0e15 {
                Value::Number(Number::from(*number as i64))
            } else {
                Number::from_f64(*number).map_or(Value::Null, Value::Number)
            }
        }
        Some(Kind::StringValue(text)) => Value::String(text.clone()),
        Some(Kind::ListValue(list)) => {
            Value::Array(list.values.iter().map(value_to_json).collect())
        }
        Some(Kind::StructValue(object)) => Value::Object(struct_to_json(object)),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn json_struct_round_trip() {
        let value = json!({"a": 1, "b": [true, null, "x", 2.5], "c": {"d": -3}});
        let Value::Object(object) = value.clone() else {
            panic!("object")
        };
        assert_eq!(
            Value::Object(struct_to_json(&json_to_struct(&object))),
            value
        );
    }

    #[test]
    fn timestamps() {
        let ts = timestamp(1_500);
        assert_eq!((ts.seconds, ts.nanos), (1, 500_000_000));
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
    }
}
