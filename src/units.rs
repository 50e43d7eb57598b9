//! Sizes rounded to whole units (pages, allocation granularity) within what a mapping can hold.

use crate::error::Result;

/// `size` bytes (at least one) rounded up to whole `unit`s, or an error naming the size where
/// that exceeds what a mapping can be (`isize::MAX` bytes).
pub(crate) fn whole_units(size: usize, unit: usize) -> Result<usize> {
    match size.max(1).checked_next_multiple_of(unit.max(1)) {
        Some(len) if isize::try_from(len).is_ok() => Ok(len),
        _ => crate::invalid_arg!(
            "size {size} bytes is more than can be mapped (at most {} bytes)",
            isize::MAX
        ),
    }
}
