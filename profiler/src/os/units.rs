//! Durations as people write and read them: `50ms`, `0.2s`, `2s`.
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DurationError {
    #[error("'{0}' is not a duration: write a number with a unit, e.g. 50ms, 0.2s, 2s, 1m")]
    Malformed(String),
    #[error("'{0}' has an unknown unit: use ns, us, ms, s, m or h (e.g. 50ms)")]
    Unit(String),
}

/// Parse `50ms`, `0.2s`, `2s`, `1m`, `750us`, `100ns` into nanoseconds.
pub fn parse_duration(s: &str) -> Result<u64, DurationError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() || num.chars().filter(|&c| c == '.').count() > 1 {
        return Err(DurationError::Malformed(s.to_string()));
    }
    let value: f64 = num
        .parse()
        .map_err(|_| DurationError::Malformed(s.to_string()))?;
    let scale = match unit.trim() {
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        "m" => 60e9,
        "h" => 3600e9,
        // Zero needs no unit.
        "" if value == 0.0 => 1.0,
        "" => return Err(DurationError::Malformed(s.to_string())),
        _ => return Err(DurationError::Unit(s.to_string())),
    };
    Ok((value * scale).round() as u64)
}

/// Human form of a nanosecond duration: `1.23s`, `85.0ms`, `420us`.
pub fn fmt_ns(ns: u64) -> String {
    if ns >= 1_000_000_000 {
        format!("{:.2}s", ns as f64 / 1e9)
    } else if ns >= 1_000_000 {
        format!("{:.1}ms", ns as f64 / 1e6)
    } else {
        format!("{}us", ns / 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("50ms"), Ok(50_000_000));
        assert_eq!(parse_duration("0.2s"), Ok(200_000_000));
        assert_eq!(parse_duration("2s"), Ok(2_000_000_000));
        assert_eq!(parse_duration("1m"), Ok(60_000_000_000));
        assert_eq!(parse_duration("750us"), Ok(750_000));
        assert_eq!(parse_duration("0"), Ok(0));
        assert!(matches!(
            parse_duration("banana"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            parse_duration("50"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            parse_duration("5 parsecs"),
            Err(DurationError::Unit(_))
        ));
        assert!(matches!(
            parse_duration("1.2.3s"),
            Err(DurationError::Malformed(_))
        ));
    }
}
