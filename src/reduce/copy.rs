//! Plain copies of bytes, around one slow case of the C library's `memcpy`.
//!
//! On x86_64, glibc copies mid-size blocks (from a few KiB up to its non-temporal threshold)
//! with `rep movsb`. On AMD Zen 3 (seen on an EPYC VM, glibc 2.36) that instruction runs
//! about twenty times slower when the destination lies 1 to 31 bytes past the source modulo
//! a 4 KiB page: 64 KiB copies at 1.7-2.6 GB/s instead of 35-45. Such distances are common
//! here: a user's page-aligned buffer against a slot's data, which starts after the slot's
//! header, or against scratch from the allocator. A loop of 32-byte (AVX) or 16-byte (SSE2)
//! unaligned loads and stores copies those at 30-38 GB/s, as fast as `memcpy` at its best,
//! so such copies take the loop; every other copy stays with `memcpy`. In the library, a
//! 2-process in-place all-to-all of 256 KiB on page-aligned buffers went from 90-130 us a
//! call to the out-of-place time.

/// The page whose offsets the slow case compares.
const PAGE: usize = 4096;
/// Distances (destination minus source, modulo `PAGE`) below this take the loop; the slow
/// ones measured were 1 to 31, and 32 to 63 cost the loop nothing.
const NEAR: usize = 64;
/// Copies shorter than this stay with `memcpy`, which uses vector moves for them.
const FROM: usize = 2048;

/// Copies `len` bytes from `src` to `dst`, as `std::ptr::copy_nonoverlapping` does.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: `src` is valid for `len` bytes of reads, `dst` for
/// `len` bytes of writes, and the two do not overlap.
#[inline]
pub(crate) unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= FROM && just_ahead(dst, src) {
        if super::stream::wide().avx() {
            // SAFETY: `wide()` just found AVX on this CPU, which is `wide_copy`'s one demand
            // beyond this function's own contract, which the caller upholds.
            unsafe { wide_copy(dst, src, len) };
        } else {
            // SAFETY: `narrow_copy` asks only this function's contract (SSE2 is baseline on
            // x86_64), which the caller upholds.
            unsafe { narrow_copy(dst, src, len) };
        }
        return;
    }
    // SAFETY: the caller promises exactly `copy_nonoverlapping`'s contract (see # Safety).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Whether `dst` lies 1 to `NEAR - 1` bytes past `src` modulo a page. The kernel's copies
/// (`process_vm_readv`/`writev`) use `rep movsb` at every size and are as slow then (two to
/// three times from memory): transports route them through memory of their own instead.
pub(crate) fn just_ahead(dst: *const u8, src: *const u8) -> bool {
    let d = (dst as usize).wrapping_sub(src as usize) % PAGE;
    d != 0 && d < NEAR
}

/// # Safety
/// The CPU has AVX; otherwise as `copy_bytes`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn wide_copy(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    let body = len & !127;
    // SAFETY: every 32-byte load and store lies in `[i, i + 128)` with `i + 128 <= body <=
    // len`, and the tail copies `[body, len)`: all inside the `len` bytes the caller vouches
    // for at `src` (reads) and `dst` (writes), which do not overlap. The loads and stores are
    // the unaligned kind, and the caller promises AVX (`#[target_feature]` above).
    unsafe {
        for i in (0..body).step_by(128) {
            let s = src.add(i) as *const __m256i;
            let d = dst.add(i) as *mut __m256i;
            let (a, b, c, e) = (
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
            );
            _mm256_storeu_si256(d, a);
            _mm256_storeu_si256(d.add(1), b);
            _mm256_storeu_si256(d.add(2), c);
            _mm256_storeu_si256(d.add(3), e);
        }
        std::ptr::copy_nonoverlapping(src.add(body), dst.add(body), len - body);
    }
}

/// # Safety
/// As `copy_bytes`.
#[cfg(target_arch = "x86_64")]
unsafe fn narrow_copy(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128};
    let body = len & !63;
    // SAFETY: every 16-byte load and store lies in `[i, i + 64)` with `i + 64 <= body <= len`,
    // and the tail copies `[body, len)`: all inside the `len` bytes the caller vouches for at
    // `src` (reads) and `dst` (writes), which do not overlap. The loads and stores are the
    // unaligned kind, and SSE2 is part of every x86_64 CPU.
    unsafe {
        for i in (0..body).step_by(64) {
            let s = src.add(i) as *const __m128i;
            let d = dst.add(i) as *mut __m128i;
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_storeu_si128(d, a);
            _mm_storeu_si128(d.add(1), b);
            _mm_storeu_si128(d.add(2), c);
            _mm_storeu_si128(d.add(3), e);
        }
        std::ptr::copy_nonoverlapping(src.add(body), dst.add(body), len - body);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path (memcpy, the AVX loop, the SSE2 loop) copies exactly the bytes asked for
    /// and nothing around them, at every distance class and at lengths around the loops'
    /// block sizes and the threshold.
    #[test]
    fn copies_exactly_at_every_distance_and_length() {
        let src: Vec<u8> = (0..3 * PAGE + 512).map(|i| (i * 7 + 3) as u8).collect();
        let lens = [
            0,
            1,
            63,
            64,
            127,
            128,
            129,
            FROM - 1,
            FROM,
            FROM + 1,
            FROM + 127,
            9001,
        ];
        for &dist in &[0usize, 1, 8, 16, 31, 32, 63, 64, 100, PAGE - 1] {
            for &len in &lens {
                for from in [0usize, 5, 64] {
                    let dst = vec![0xEEu8; 3 * PAGE + 1024];
                    // Place dst so that dst - src is `dist` modulo a page.
                    let s = src[from..].as_ptr();
                    let base = dst.as_ptr();
                    let want = (s as usize + dist) % PAGE;
                    let at = (want + PAGE - base as usize % PAGE) % PAGE;
                    assert_eq!(
                        just_ahead(base.wrapping_add(at), s),
                        dist != 0 && dist < NEAR
                    );
                    let run = |f: unsafe fn(*mut u8, *const u8, usize)| {
                        let mut d = dst.clone();
                        // SAFETY: `at < PAGE` and `d` holds `3 * PAGE + 1024` bytes.
                        let p = unsafe { d.as_mut_ptr().add(at) };
                        // SAFETY: `at + len` and `from + len` stay within `d` and `src` (both
                        // over 3 pages, `len` under 10000); `d` is a fresh copy, apart from
                        // `src`; the AVX path runs only where `wide()` found AVX.
                        unsafe { f(p, s, len) };
                        assert_eq!(&d[at..at + len], &src[from..from + len], "{dist} {len}");
                        assert!(d[..at].iter().all(|&b| b == 0xEE), "{dist} {len}");
                        assert!(d[at + len..].iter().all(|&b| b == 0xEE), "{dist} {len}");
                    };
                    run(copy_bytes);
                    #[cfg(target_arch = "x86_64")]
                    {
                        run(narrow_copy);
                        if super::super::stream::wide().avx() {
                            run(wide_copy);
                        }
                    }
                }
            }
        }
    }
}
