//! Executors carry schedules out: `host` with the CPU on host memory, `device` as a program
//! of stream operations for device memory.

pub(crate) mod anysource;
pub(crate) mod device;
pub(crate) mod host;
pub(crate) mod op;
pub(crate) mod ranges;
pub(crate) mod replies;

/// TEMPORARY, for measuring what each short way for repeated calls buys: `COMM_XOFF`, a
/// comma-separated list of `lane`, `again`, `memo`, `hazards`, `built`, `straight`, turns
/// those layers off. Removed before the branch is merged.
pub(crate) mod xoff {
    pub(crate) const LANE: u32 = 1;
    pub(crate) const AGAIN: u32 = 2;
    pub(crate) const MEMO: u32 = 4;
    pub(crate) const HAZARDS: u32 = 8;
    pub(crate) const BUILT: u32 = 16;
    pub(crate) const STRAIGHT: u32 = 32;
    static OFF: std::sync::LazyLock<u32> = std::sync::LazyLock::new(|| {
        let v = std::env::var("COMM_XOFF").unwrap_or_default();
        let names = ["lane", "again", "memo", "hazards", "built", "straight"];
        v.split(',')
            .filter_map(|n| names.iter().position(|m| *m == n.trim()))
            .fold(0, |a, i| a | 1 << i)
    });
    #[inline]
    pub(crate) fn off(layer: u32) -> bool {
        *OFF & layer != 0
    }
}
