//! Byte quantities as operators write them: `268435456`, `256Mi`, `80GiB`, `1.5Gi`.
//!
//! Binary suffixes (`Ki`, `Mi`, `Gi`, `Ti`, with or without a trailing `B`) are powers
//! of 1024; a bare `B` or no suffix means bytes. Decimal SI suffixes (`K`, `M`, `G`) are
//! rejected on purpose: "8G" is ambiguous between 8·10⁹ and 8·2³⁰, and a GPU memory
//! quota that is 7 % off is a bug, not a rounding detail.

use std::fmt;

/// Why a byte quantity could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ByteSizeError {
    /// The text was empty or only white space.
    #[error("empty byte quantity")]
    Empty,
    /// The numeric part is not a number.
    #[error("invalid byte quantity {0:?}: expected a number with an optional Ki/Mi/Gi/Ti suffix")]
    NotANumber(String),
    /// The suffix is not one we accept.
    #[error(
        "invalid byte quantity {0:?}: unknown unit {1:?} (use B, Ki, Mi, Gi, Ti, KiB, MiB, GiB or TiB)"
    )]
    UnknownUnit(String, String),
    /// The value does not fit in 64 bits of bytes.
    #[error("byte quantity {0:?} is too large")]
    Overflow(String),
    /// A fractional number of bytes was given.
    #[error("byte quantity {0:?} is not a whole number of bytes")]
    Fractional(String),
}

const KI: u64 = 1 << 10;
const MI: u64 = 1 << 20;
const GI: u64 = 1 << 30;
const TI: u64 = 1 << 40;

/// Parses a byte quantity such as `256Mi`, `80GiB`, `1.5Gi` or `4096`.
///
/// Fractions are allowed with a unit as long as the result is a whole number of bytes.
pub fn parse_bytes(text: &str) -> Result<u64, ByteSizeError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(ByteSizeError::Empty);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    if num.is_empty() {
        return Err(ByteSizeError::NotANumber(text.to_owned()));
    }
    let mult = match unit {
        "" | "B" => 1,
        "Ki" | "KiB" => KI,
        "Mi" | "MiB" => MI,
        "Gi" | "GiB" => GI,
        "Ti" | "TiB" => TI,
        other => {
            return Err(ByteSizeError::UnknownUnit(
                text.to_owned(),
                other.to_owned(),
            ));
        }
    };
    let num: String = num.chars().filter(|&c| c != '_').collect();
    if num.is_empty() || num.starts_with('.') || num.ends_with('.') || num.matches('.').count() > 1
    {
        return Err(ByteSizeError::NotANumber(text.to_owned()));
    }
    let (int_part, frac_part) = num.split_once('.').unwrap_or((&num, ""));
    let int: u64 = int_part
        .parse()
        .map_err(|_| ByteSizeError::Overflow(text.to_owned()))?;
    let mut total = int
        .checked_mul(mult)
        .ok_or_else(|| ByteSizeError::Overflow(text.to_owned()))?;
    if !frac_part.is_empty() {
        // value = frac_digits / 10^len * mult, which must be whole.
        if frac_part.len() > 18 {
            return Err(ByteSizeError::Fractional(text.to_owned()));
        }
        let digits: u128 = frac_part
            .parse()
            .map_err(|_| ByteSizeError::NotANumber(text.to_owned()))?;
        let scale = 10u128.pow(frac_part.len() as u32);
        let scaled = digits * u128::from(mult);
        if !scaled.is_multiple_of(scale) {
            return Err(ByteSizeError::Fractional(text.to_owned()));
        }
        let add =
            u64::try_from(scaled / scale).map_err(|_| ByteSizeError::Overflow(text.to_owned()))?;
        total = total
            .checked_add(add)
            .ok_or_else(|| ByteSizeError::Overflow(text.to_owned()))?;
    }
    Ok(total)
}

/// Formats bytes with the largest binary unit that divides them exactly (`256Mi`), or in
/// GiB with two decimals for display when `exact` is false.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        for (unit, m) in [("Ti", TI), ("Gi", GI), ("Mi", MI), ("Ki", KI)] {
            if b >= m && b.is_multiple_of(m) {
                return write!(f, "{}{unit}", b / m);
            }
        }
        if b >= GI {
            write!(f, "{:.2}Gi", b as f64 / GI as f64)
        } else if b >= MI {
            write!(f, "{:.2}Mi", b as f64 / MI as f64)
        } else {
            write!(f, "{b}B")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("256Mi"), Ok(256 * MI));
        assert_eq!(parse_bytes("256MiB"), Ok(256 * MI));
        assert_eq!(parse_bytes(" 80GiB "), Ok(80 * GI));
        assert_eq!(parse_bytes("1.5Gi"), Ok(GI + GI / 2));
        assert_eq!(parse_bytes("1_024Ki"), Ok(1024 * KI));
        assert_eq!(parse_bytes("2Ti"), Ok(2 * TI));
    }

    #[test]
    fn rejects_bad_input_naming_it() {
        assert_eq!(parse_bytes(""), Err(ByteSizeError::Empty));
        let e = parse_bytes("8G").unwrap_err();
        assert_eq!(e, ByteSizeError::UnknownUnit("8G".into(), "G".into()));
        assert!(e.to_string().contains("\"8G\""));
        assert!(matches!(
            parse_bytes("abc"),
            Err(ByteSizeError::NotANumber(_))
        ));
        assert!(matches!(
            parse_bytes("-1"),
            Err(ByteSizeError::NotANumber(_))
        ));
        assert!(matches!(
            parse_bytes("1.2.3Mi"),
            Err(ByteSizeError::NotANumber(_))
        ));
        assert!(matches!(
            parse_bytes("0.3"),
            Err(ByteSizeError::Fractional(_))
        ));
        assert!(matches!(
            parse_bytes("99999999999Ti"),
            Err(ByteSizeError::Overflow(_))
        ));
        assert!(matches!(
            parse_bytes("18446744073709551616"),
            Err(ByteSizeError::Overflow(_))
        ));
    }

    #[test]
    fn displays_exact_units() {
        assert_eq!(Bytes(256 * MI).to_string(), "256Mi");
        assert_eq!(Bytes(80 * GI).to_string(), "80Gi");
        assert_eq!(Bytes(100).to_string(), "100B");
    }

    proptest! {
        #[test]
        fn display_round_trips_exact_values(n in 0u64..(1u64 << 50)) {
            let s = Bytes(n).to_string();
            if !s.contains('.') {
                prop_assert_eq!(parse_bytes(&s), Ok(n));
            }
        }

        #[test]
        fn never_panics(s in "\\PC{0,24}") {
            let _ = parse_bytes(&s);
        }
    }
}
