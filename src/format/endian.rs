//! The little-endian check. The format stores numbers little-endian and this
//! crate hands tensor bytes through untouched, so a big-endian host must stop.

use crate::error::{Error, ErrorKind, Result};

/// Byte orders a host can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteOrder {
    Little,
    Big,
}

/// This host's byte order.
pub const fn host_byte_order() -> ByteOrder {
    if cfg!(target_endian = "little") {
        ByteOrder::Little
    } else {
        ByteOrder::Big
    }
}

/// Fails on a big-endian byte order; a parameter so tests can drive both.
pub fn ensure_little_endian(order: ByteOrder) -> Result<()> {
    match order {
        ByteOrder::Little => Ok(()),
        ByteOrder::Big => Err(Error::new(ErrorKind::BigEndianHost)),
    }
}

/// [`ensure_little_endian`] for this host: called by every load and save.
pub fn ensure_host_little_endian() -> Result<()> {
    ensure_little_endian(host_byte_order())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_endian_is_refused_with_a_clear_error() {
        let err = ensure_little_endian(ByteOrder::Big).unwrap_err();
        assert!(matches!(err.kind(), ErrorKind::BigEndianHost));
        assert!(err.to_string().contains("big-endian"));
        ensure_little_endian(ByteOrder::Little).unwrap();
    }
}
