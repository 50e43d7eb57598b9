//! Copies with non-temporal stores, for results written to memory that nothing will read
//! soon: they skip reading the destination's lines into the cache first (a store into memory
//! nothing has cached otherwise reads it too) and do not push the cache's other contents out.
//! Such stores are weakly ordered: `stream_fence` orders them before any later store, such as
//! the release that tells a peer the bytes are there.
//!
//! Where the CPU has AVX the body goes 32 bytes a store: in a model of two processes folding
//! 32 MiB each into a shared FIFO and into memory nothing caches, 64-byte stores took a fifth
//! less time than 16-byte ones, and in the library 32-byte ones did as well as 64-byte ones
//! (which need AVX-512 intrinsics, newer than the crate's minimum Rust). Elsewhere on x86_64 the
//! stores are SSE2's; other architectures copy plainly.

/// Whether 32-byte (AVX) stores may run, as only `wide()` can find out: the functions that run
/// AVX instructions when it says yes take it, so that no caller can claim AVX it did not detect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Wide(bool);

impl Wide {
    /// No AVX: 16-byte stores only.
    pub(super) const NARROW: Wide = Wide(false);

    /// Whether the CPU has AVX.
    pub(super) fn avx(self) -> bool {
        self.0
    }
}

/// Whether 32-byte stores are available (cached by the standard library after the first look).
pub(super) fn wide() -> Wide {
    #[cfg(target_arch = "x86_64")]
    return Wide(std::arch::is_x86_feature_detected!("avx"));
    #[cfg(not(target_arch = "x86_64"))]
    Wide(false)
}

/// Copies `len` bytes from `src` to `dst` with non-temporal stores; `fence`: then
/// `stream_fence`.
///
/// # Safety
/// `dst` and `src` cover `len` bytes and do not overlap.
pub(crate) unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize, fence: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        let head = dst.align_offset(64).min(len);
        // SAFETY: `head <= len`, inside the two non-overlapping ranges the caller vouches for.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let body = (len - head) & !63;
        // SAFETY: `head <= len`, so both stay within (or one past) the caller's ranges.
        let (d, s) = unsafe { (dst.add(head), src.add(head)) };
        // SAFETY: `[head, head + body)` lies within `len` (`body <= len - head`) and is a
        // multiple of 64; `d` is 64-byte aligned whenever `body > 0` (`head` is then
        // `dst`'s offset to a line, not clamped to `len`); `lines` runs only where `wide()`
        // found AVX.
        unsafe {
            if wide().0 {
                lines(d, s, body);
            } else {
                quarters(d, s, body);
            }
        }
        let done = head + body;
        // SAFETY: `[done, len)` is the rest of the caller's ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) };
    }
    // SAFETY: the caller's contract is `copy_nonoverlapping`'s.
    #[cfg(not(target_arch = "x86_64"))]
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    };
    if fence {
        stream_fence();
    }
}

/// Orders earlier non-temporal stores before every later store.
pub(crate) fn stream_fence() {
    // SAFETY: sfence has no operands and is part of SSE, which every x86_64 CPU has.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Copies `from` to `streamed` with non-temporal stores (unfenced). `wide`: as `wide()` said.
#[inline(always)]
pub(super) fn stream_from(streamed: &mut [u8], from: &[u8], wide: Wide) {
    debug_assert_eq!(streamed.len(), from.len());
    #[cfg(target_arch = "x86_64")]
    if wide.0 && streamed.as_ptr() as usize % 64 == 0 && from.len() % 64 == 0 {
        // SAFETY: `wide()` saw AVX; both cover from.len() bytes, a multiple of 64, and
        // the destination is line-aligned.
        unsafe { lines(streamed.as_mut_ptr(), from.as_ptr(), from.len()) };
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = wide;
    // SAFETY: distinct buffers of the same length.
    unsafe { stream_copy(streamed.as_mut_ptr(), from.as_ptr(), from.len(), false) };
}

/// Writes `bytes` to `streamed` with non-temporal stores (unfenced) and to `also` with plain
/// ones, reading them once. `wide`: as `wide()` said.
#[inline(always)]
pub(super) fn emit_twice(streamed: &mut [u8], also: &mut [u8], bytes: &[u8], wide: Wide) {
    debug_assert!(streamed.len() == bytes.len() && also.len() == bytes.len());
    #[cfg(target_arch = "x86_64")]
    if streamed.as_ptr() as usize % 64 == 0 && bytes.len() % 64 == 0 {
        let (s, d, b) = (streamed.as_mut_ptr(), also.as_mut_ptr(), bytes.as_ptr());
        // SAFETY: all three cover bytes.len() bytes, a multiple of 64; the streamed
        // destination is line-aligned; `lines_twice` only where `wide()` saw AVX.
        unsafe {
            if wide.0 {
                lines_twice(s, d, b, bytes.len());
            } else {
                quarters_twice(s, d, b, bytes.len());
            }
        }
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = wide;
    stream_from(streamed, bytes, Wide::NARROW);
    also.copy_from_slice(bytes);
}

/// # Safety
/// The CPU has AVX; `dst` (line-aligned) and `src` cover `len` bytes, a multiple of 64.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn lines(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    // SAFETY: each access covers `[i, i + 32)` with `i + 32 <= len` (a multiple of 64, so
    // of 32), inside both ranges the caller vouches for; the loads are unaligned ones and
    // the streaming stores land on 32-byte boundaries of the line-aligned `dst`, as
    // `_mm256_stream_si256` requires; the caller promises AVX (`#[target_feature]`).
    unsafe {
        for i in (0..len).step_by(32) {
            let v = _mm256_loadu_si256(src.add(i) as *const __m256i);
            _mm256_stream_si256(dst.add(i) as *mut __m256i, v);
        }
    }
}

/// # Safety
/// `dst` (line-aligned) and `src` cover `len` bytes, a multiple of 64.
#[cfg(target_arch = "x86_64")]
unsafe fn quarters(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // SAFETY: each access covers `[i, i + 16)` with `i + 16 <= len` (a multiple of 64),
    // inside both ranges the caller vouches for; the loads are unaligned ones and the
    // streaming stores land on 16-byte boundaries of the line-aligned `dst`, as
    // `_mm_stream_si128` requires; SSE2 is part of every x86_64 CPU.
    unsafe {
        for i in (0..len).step_by(16) {
            let v = _mm_loadu_si128(src.add(i) as *const __m128i);
            _mm_stream_si128(dst.add(i) as *mut __m128i, v);
        }
    }
}

/// # Safety
/// The CPU has AVX; `streamed` (line-aligned), `also` and `src` cover `len` bytes, a
/// multiple of 64.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn lines_twice(streamed: *mut u8, also: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_storeu_si256, _mm256_stream_si256,
    };
    // SAFETY: each access covers `[i, i + 32)` with `i + 32 <= len` (a multiple of 64),
    // inside the three ranges the caller vouches for; the load and the plain store are
    // unaligned ones and the streaming store lands on a 32-byte boundary of the line-aligned
    // `streamed`, as `_mm256_stream_si256` requires; the caller promises AVX.
    unsafe {
        for i in (0..len).step_by(32) {
            let v = _mm256_loadu_si256(src.add(i) as *const __m256i);
            _mm256_stream_si256(streamed.add(i) as *mut __m256i, v);
            _mm256_storeu_si256(also.add(i) as *mut __m256i, v);
        }
    }
}

/// # Safety
/// As `lines_twice`, without the AVX requirement.
#[cfg(target_arch = "x86_64")]
unsafe fn quarters_twice(streamed: *mut u8, also: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128, _mm_stream_si128};
    // SAFETY: each access covers `[i, i + 16)` with `i + 16 <= len` (a multiple of 64),
    // inside the three ranges the caller vouches for; the load and the plain store are
    // unaligned ones and the streaming store lands on a 16-byte boundary of the line-aligned
    // `streamed`, as `_mm_stream_si128` requires; SSE2 is part of every x86_64 CPU.
    unsafe {
        for i in (0..len).step_by(16) {
            let v = _mm_loadu_si128(src.add(i) as *const __m128i);
            _mm_stream_si128(streamed.add(i) as *mut __m128i, v);
            _mm_storeu_si128(also.add(i) as *mut __m128i, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn streamed_copies_match_the_source_at_every_alignment_and_length() {
        let widths: &[Wide] = if super::wide() == Wide::NARROW {
            &[Wide::NARROW]
        } else {
            &[Wide::NARROW, super::wide()]
        };
        for &wide in widths {
            for len in [0, 1, 15, 16, 63, 64, 65, 127, 128, 1000, 4096, 4099] {
                for skew in [0, 1, 16, 63] {
                    let src = pattern(len + skew);
                    let src = &src[skew..];
                    let mut a = vec![0u8; len + 128];
                    let mut b = vec![0u8; len + 128];
                    // SAFETY: a covers len + 128 bytes, so len past any skew below 64.
                    unsafe { stream_copy(a.as_mut_ptr().add(skew), src.as_ptr(), len, true) };
                    assert_eq!(
                        &a[skew..skew + len],
                        src,
                        "stream_copy len {len} skew {skew}"
                    );
                    assert!(a[..skew].iter().chain(&a[skew + len..]).all(|&x| x == 0));
                    let at = a.as_ptr().align_offset(64);
                    let (s, d) = (&mut a[at..at + len], &mut b[skew..skew + len]);
                    s.fill(0);
                    emit_twice(s, d, src, wide);
                    stream_fence();
                    assert_eq!(&a[at..at + len], src, "emit_twice streamed, len {len}");
                    assert_eq!(&b[skew..skew + len], src, "emit_twice also, len {len}");
                    a[at..at + len].fill(0);
                    stream_from(&mut a[at..at + len], src, wide);
                    stream_fence();
                    assert_eq!(&a[at..at + len], src, "stream_from len {len}");
                }
            }
        }
    }
}
