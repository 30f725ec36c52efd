//! Conversions between JSON, protobuf well-known types and stored values.

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

pub(crate) use troupe_proto::json::{
    object_to_struct as json_to_struct, struct_to_object as struct_to_json,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        let ts = timestamp(1_500);
        assert_eq!((ts.seconds, ts.nanos), (1, 500_000_000));
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
    }
}
