//! The Linux primitives the host transports, the executor's CPU placement and the windows are
//! built from: memfd segments, shared mappings, futex waits, pidfds, cross-process reads (CMA)
//! and fd passing over unix sockets.

use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::Duration;

/// An anonymous shared-memory file of `len` bytes, zero-filled; pages cost nothing until touched.
pub(crate) fn memfd(name: &str, len: usize) -> Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).expect("memfd name has no NUL");
    // SAFETY: cname is a valid C string; flags are plain constants.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::last_os("memfd_create"));
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fd is a valid memfd; ftruncate only sets its size.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(Error::last_os(format!(
            "ftruncate of a {len}-byte shared segment"
        )));
    }
    Ok(fd)
}

/// A shared read-write mapping of a whole file, unmapped on drop.
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all concurrent access to it goes through atomics or
// through the FIFO protocol that hands regions from one side to the other.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn map(fd: RawFd, len: usize) -> Result<Mapping> {
        // SAFETY: a fresh shared mapping chosen by the kernel; fd refers to a file of at least len bytes.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::last_os(format!(
                "mmap of a {len}-byte shared segment"
            )));
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned; nothing uses the mapping after drop.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Private anonymous memory, 2 MiB-aligned and backed by transparent huge pages where the
/// kernel allows: the kernel pins such memory in far fewer steps when process_vm_readv copies
/// into or out of it.
pub(crate) struct HugeMem {
    base: *mut u8,
    len: usize,
    ptr: *mut u8,
}

// SAFETY: plain private memory owned by this value.
unsafe impl Send for HugeMem {}

const HUGE_PAGE: usize = 2 << 20;

impl HugeMem {
    pub(crate) fn new(len: usize) -> Result<HugeMem> {
        let total = len.next_multiple_of(HUGE_PAGE) + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping chosen by the kernel.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::last_os(format!("mmap of {total} bytes of scratch")));
        }
        let ptr = (base as usize).next_multiple_of(HUGE_PAGE) as *mut u8;
        // SAFETY: [ptr, ptr+len) lies inside the mapping; the advice is only a hint.
        unsafe {
            libc::madvise(
                ptr.cast(),
                len.next_multiple_of(HUGE_PAGE),
                libc::MADV_HUGEPAGE,
            )
        };
        Ok(HugeMem {
            base: base.cast(),
            len: total,
            ptr,
        })
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for HugeMem {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly the mapping made in new().
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// How many times `collapse_to_huge_pages` advised or collapsed a range in this process: a
/// call that did runs slower for it (the collapse copies every page; the advised range is
/// still on small pages), which timing `exec::replies` leaves out.
pub(crate) static PAGES_ADVISED: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// Asks the kernel to back the whole 2 MiB pages inside `[ptr, ptr+len)` with huge pages, so
/// that process_vm_readv pins them in a few steps instead of one per 4 KiB page: MADV_HUGEPAGE
/// for pages not faulted in yet, MADV_COLLAPSE (Linux 6.1+) for those already there. Contents
/// are unchanged; failure (older kernel, no free huge pages) only means the optimisation does
/// not apply. Regions already done are remembered.
///
/// The collapse copies every page it gathers, which costs more than a call pinning 4 KiB pages
/// saves: a buffer used once (a broadcast of weights at start-up, a tensor made for one call)
/// would pay it for nothing. So a range is only advised the first time it comes, and collapsed
/// the second time (`Regions`).
pub(crate) fn collapse_to_huge_pages(ptr: usize, len: usize) {
    static REGIONS: Mutex<Option<Regions>> = Mutex::new(None);
    const MADV_COLLAPSE: i32 = 25;
    let start = ptr.next_multiple_of(HUGE_PAGE);
    let end = (ptr + len) & !(HUGE_PAGE - 1);
    if end <= start {
        return;
    }
    let mut regions = REGIONS.lock();
    let advice = regions
        .get_or_insert_with(Regions::default)
        .sighted(start, end);
    let Some(collapse) = advice else {
        return;
    };
    PAGES_ADVISED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: the range lies inside memory the caller hands us for an operation; the advice
    // leaves its contents as they are.
    let r = unsafe {
        let p = start as *mut libc::c_void;
        libc::madvise(p, end - start, libc::MADV_HUGEPAGE);
        if collapse {
            // EINVAL when nothing is faulted in yet: MADV_HUGEPAGE covers that case.
            libc::madvise(p, end - start, MADV_COLLAPSE)
        } else {
            0
        }
    };
    crate::trace!(
        "{} of {} MiB at {start:#x}: {}",
        if collapse {
            "MADV_COLLAPSE"
        } else {
            "MADV_HUGEPAGE"
        },
        (end - start) >> 20,
        if r == 0 {
            "done".to_string()
        } else {
            std::io::Error::last_os_error().to_string()
        }
    );
}

/// The 2 MiB regions of buffers seen once (advised) and twice (collapsed).
#[derive(Default)]
struct Regions {
    seen: std::collections::HashSet<usize>,
    done: std::collections::HashSet<usize>,
}

impl Regions {
    /// Records a sighting of the huge pages `[start, end)`: None when every one of them is
    /// collapsed already, Some(false) to advise them (some come for the first time), Some(true)
    /// to collapse them.
    fn sighted(&mut self, start: usize, end: usize) -> Option<bool> {
        let pages = (start..end).step_by(HUGE_PAGE);
        if pages.clone().all(|p| self.done.contains(&p)) {
            return None;
        }
        // Bounded: a process that churns through buffers must not grow these forever.
        for set in [&mut self.seen, &mut self.done] {
            if set.len() > 1 << 16 {
                set.clear();
            }
        }
        if pages
            .clone()
            .any(|p| !self.seen.contains(&p) && !self.done.contains(&p))
        {
            self.seen.extend(pages);
            return Some(false);
        }
        for p in pages {
            self.seen.remove(&p);
            self.done.insert(p);
        }
        Some(true)
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout`. Works across processes because the
/// word lives in a MAP_SHARED mapping (no FUTEX_PRIVATE_FLAG).
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: word is a valid, aligned u32 for the duration of the call; the kernel only reads it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

pub(crate) fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: as in futex_wait; FUTEX_WAKE does not touch the word's value.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// The calling thread's affinity mask; None where the kernel does not say.
fn affinity() -> Option<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is plain bits; zeroed is an empty set.
    let mut mask: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `mask` is a valid cpu_set_t of its size; 0 names the calling thread.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&mask), &mut mask) };
    (r == 0).then_some(mask)
}

/// The CPUs the calling thread may run on, in order (empty where the kernel does not say).
#[cfg(test)]
pub(crate) fn cpus_allowed() -> Vec<u32> {
    affinity().map_or_else(Vec::new, |m| cpus_of(&m).collect())
}

/// The CPUs of `mask`, in order.
fn cpus_of(mask: &libc::cpu_set_t) -> impl Iterator<Item = u32> + '_ {
    // SAFETY: c is below CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as u32).filter(move |&c| unsafe { libc::CPU_ISSET(c as usize, mask) })
}

/// Moves the calling thread onto `to`, then gives it back `mask`, its own affinity mask (it
/// stays where it landed until the scheduler moves it). Whether it moved.
fn hop(to: u32, mask: &libc::cpu_set_t) -> bool {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: cpu_set_t is plain bits; zeroed is an empty set.
    let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `to` is below CPU_SETSIZE (a CPU of a mask).
    unsafe { libc::CPU_SET(to as usize, &mut one) };
    // SAFETY: valid sets of `size` bytes for the calling thread. The first call returns once
    // the thread runs on `to`; the second gives the caller's own mask back.
    let moved = unsafe { libc::sched_setaffinity(0, size, &one) } == 0;
    // SAFETY: as above.
    unsafe { libc::sched_setaffinity(0, size, mask) };
    moved
}

/// Moves the calling thread off CPU `from` onto another CPU of its affinity mask that is not in
/// `avoid`, and gives the mask back (the thread stays where it landed until the scheduler moves
/// it). `announce` is told the CPU before the move, which takes tens of microseconds. Returns
/// the CPU it moved to, or None where there is no such CPU or the kernel refused.
pub(crate) fn move_off_cpu(from: u32, avoid: &[u32], announce: impl FnOnce(u32)) -> Option<u32> {
    let mask = affinity()?;
    let to = cpus_of(&mask).find(|&c| c != from && !avoid.contains(&c))?;
    announce(to);
    hop(to, &mask).then_some(to)
}

/// Moves the calling thread onto the CPU numbered `n` (modulo their count) among those of its
/// affinity mask, and gives the mask back. Returns the CPU, or None where it ran there already,
/// the mask has one CPU or the kernel refused.
pub(crate) fn move_to_nth_cpu(n: usize) -> Option<u32> {
    let mask = affinity()?;
    // SAFETY: a valid cpu_set_t.
    let count = unsafe { libc::CPU_COUNT(&mask) } as usize;
    if count <= 1 {
        return None;
    }
    let to = cpus_of(&mask).nth(n % count)?;
    // SAFETY: sched_getcpu has no preconditions.
    if unsafe { libc::sched_getcpu() } == to as i32 {
        return None;
    }
    hop(to, &mask).then_some(to)
}

/// The calling thread's CPU affinity mask as it was before `hold_for_sleep` narrowed it;
/// dropping this gives the mask back.
pub(crate) struct Narrowed {
    mask: libc::cpu_set_t,
}

impl Drop for Narrowed {
    fn drop(&mut self) {
        // SAFETY: a valid cpu_set_t for the calling thread (0); the thread runs on a CPU of
        // the narrowed mask, which the whole one holds, so nothing moves.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.mask) };
    }
}

/// Narrows the calling thread's affinity mask, which it runs under on `cpu`, for a sleep,
/// until the returned guard is dropped: to `cpu` alone where `avoid` does not hold it, else to
/// the mask without the CPUs in `avoid` (the thread moves at once). None, having changed
/// nothing, where the mask has one CPU, where no CPU would be left or none taken away, or
/// where the kernel refuses.
///
/// A wake-up goes to the waker's CPU when the kernel deems the sleeper's own CPU no better
/// (on a VM it cannot tell an idle virtual CPU from one its host took away, and picks the
/// waker's): a rank woken by its peer would wait behind that peer, on its CPU, while its own
/// CPU idles. With the mask narrowed the wake-up lands where the rank slept, or at least off
/// the CPUs in `avoid`, where its peers run.
pub(crate) fn hold_for_sleep(cpu: u32, avoid: &[u32]) -> Option<Narrowed> {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    let below = |c: u32| (c as usize) < libc::CPU_SETSIZE as usize;
    let mask = affinity()?;
    // SAFETY: a valid cpu_set_t.
    let total = unsafe { libc::CPU_COUNT(&mask) };
    if total <= 1 {
        return None;
    }
    // SAFETY: cpu_set_t is plain bits; zeroed is an empty set.
    let mut narrow: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE where it is looked up or set.
    if below(cpu) && !avoid.contains(&cpu) && unsafe { libc::CPU_ISSET(cpu as usize, &mask) } {
        // SAFETY: as above.
        unsafe { libc::CPU_SET(cpu as usize, &mut narrow) };
    } else {
        narrow = mask;
        for &c in avoid.iter().filter(|&&c| below(c)) {
            // SAFETY: c is below CPU_SETSIZE.
            unsafe { libc::CPU_CLR(c as usize, &mut narrow) };
        }
        // SAFETY: a valid cpu_set_t.
        let left = unsafe { libc::CPU_COUNT(&narrow) };
        if left == 0 || left == total {
            return None;
        }
    }
    // SAFETY: a valid, non-empty cpu_set_t of `size` bytes for the calling thread.
    (unsafe { libc::sched_setaffinity(0, size, &narrow) } == 0).then_some(Narrowed { mask })
}

/// A handle on another process that says when it has exited, immune to pid reuse.
pub(crate) struct ProcessWatch {
    pid: u32,
    pidfd: Option<OwnedFd>,
}

impl ProcessWatch {
    pub(crate) fn new(pid: u32) -> ProcessWatch {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        let pidfd = if fd >= 0 {
            // SAFETY: a fresh descriptor from pidfd_open.
            Some(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
        } else {
            None
        };
        ProcessWatch { pid, pidfd }
    }

    /// A duplicate of descriptor `fd` of the watched process (as `take_fd`, through the
    /// watch's own pidfd: one descriptor and two system calls fewer).
    pub(crate) fn take_fd(&self, fd: RawFd) -> Result<OwnedFd> {
        let Some(pidfd) = &self.pidfd else {
            return take_fd(self.pid, fd);
        };
        // SAFETY: as in take_fd.
        let new = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if new < 0 {
            return Err(getfd_failed(self.pid, fd));
        }
        // SAFETY: a fresh descriptor that we own.
        Ok(unsafe { OwnedFd::from_raw_fd(new as RawFd) })
    }

    pub(crate) fn alive(&self) -> bool {
        match &self.pidfd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, zero timeout.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                n <= 0 || p.revents & libc::POLLIN == 0
            }
            None => {
                // SAFETY: signal 0 only checks that the process exists.
                let r = unsafe { libc::kill(self.pid as libc::pid_t, 0) };
                r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
            }
        }
    }
}

/// Copies `len` bytes from address `remote` in process `pid` to `local` (process_vm_readv).
///
/// # Safety
/// `local` must be valid for `len` bytes of writes.
pub(crate) unsafe fn cma_read(
    pid: u32,
    local: *mut u8,
    remote: usize,
    len: usize,
) -> io::Result<()> {
    // SAFETY: reading from the remote process writes `local`, which the caller vouches for
    // (`len` bytes of writes): `cma_copy`'s contract.
    unsafe { cma_copy(pid, local, remote, len, false) }
}

/// Copies `len` bytes from `local` to address `remote` in process `pid` (process_vm_writev).
///
/// # Safety
/// `local` must be valid for `len` bytes of reads.
pub(crate) unsafe fn cma_write(
    pid: u32,
    local: *const u8,
    remote: usize,
    len: usize,
) -> io::Result<()> {
    // SAFETY: with `write` set, `cma_copy` only reads `local` (process_vm_writev's local
    // side), for which the caller vouches; the `cast_mut` is never written through.
    unsafe { cma_copy(pid, local.cast_mut(), remote, len, true) }
}

/// # Safety
/// `local` must be valid for `len` bytes (of writes when reading from the remote process).
unsafe fn cma_copy(
    pid: u32,
    local: *mut u8,
    remote: usize,
    len: usize,
    write: bool,
) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let liov = libc::iovec {
            // SAFETY: `done < len`, inside the `len` bytes the caller vouches for at `local`.
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: len - done,
        };
        let riov = libc::iovec {
            iov_base: (remote + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: one iovec on each side, both live for the call; the local one covers the
        // rest of the caller's range (read for a write, written for a read, as promised); the
        // remote one is checked by the kernel against `pid`'s mappings (EFAULT, not UB here).
        let n = unsafe {
            if write {
                libc::process_vm_writev(pid as libc::pid_t, &liov, 1, &riov, 1, 0)
            } else {
                libc::process_vm_readv(pid as libc::pid_t, &liov, 1, &riov, 1, 0)
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm_readv/writev copied nothing",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Waits until `fd` is readable (for a listener: a connection is queued) or `timeout` passes;
/// returns whether it is readable. An interrupted wait counts as a timeout: callers loop.
pub(crate) fn wait_readable(fd: RawFd, timeout: Duration) -> Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: p is one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(Error::from_io("poll", e));
    }
    Ok(n > 0)
}

/// Sends one file descriptor (and one byte, so the message is not empty) over a unix socket.
pub(crate) fn send_fd(sock: &UnixStream, fd: RawFd) -> Result<()> {
    let mut byte = [0x5au8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: msghdr is plain data; zeroed is a valid start.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points to a buffer large enough for one SCM_RIGHTS header plus one fd.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    // SAFETY: msg and everything it points to are valid for the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n != 1 {
        return Err(Error::last_os("sendmsg(SCM_RIGHTS)"));
    }
    Ok(())
}

/// Receives one file descriptor sent by [`send_fd`].
pub(crate) fn recv_fd(sock: &UnixStream) -> Result<OwnedFd> {
    let mut byte = [0u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: msghdr is plain data; zeroed is a valid start.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points to valid buffers for the duration of the call.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(Error::last_os("recvmsg(SCM_RIGHTS)"));
    }
    if n == 0 {
        return crate::remote_err!("peer closed the socket before sending its shared segment");
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        // The kernel could not install the descriptor here: this process is out of them.
        return Err(Error::new(
            crate::error::ErrorKind::System,
            format!(
                "could not receive a peer's shared segment: this process has no file descriptor left (limit {}; raise it with ulimit -n)",
                fd_limit().map_or_else(|| "unknown".to_string(), |n| n.to_string())
            ),
        ));
    }
    // SAFETY: the kernel filled msg_control; CMSG_FIRSTHDR/CMSG_DATA stay inside it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null()
            || (*cmsg).cmsg_level != libc::SOL_SOCKET
            || (*cmsg).cmsg_type != libc::SCM_RIGHTS
        {
            return crate::remote_err!("peer sent no file descriptor for its shared segment");
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// This process's limit on open file descriptors (RLIMIT_NOFILE's soft limit).
fn fd_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0).then_some(r.rlim_cur)
}

/// A duplicate of descriptor `fd` of process `pid` (pidfd_getfd: Linux 5.6 or later, and the
/// same permission as ptrace, which process_vm_readv needs too).
pub(crate) fn take_fd(pid: u32, fd: RawFd) -> Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(Error::last_os(format!("pidfd_open({pid})")));
    }
    // SAFETY: pidfd_open returned a fresh descriptor that we own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number and flags; returns a new
    // (close-on-exec) descriptor or -1.
    let new = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if new < 0 {
        return Err(getfd_failed(pid, fd));
    }
    // SAFETY: a fresh descriptor that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(new as RawFd) })
}

/// The error of a pidfd_getfd that just failed: ncclRemoteError when the process is exiting
/// (ESRCH comes as soon as it has let go of its descriptors, before its pidfd says it ended),
/// a system error otherwise.
fn getfd_failed(pid: u32, fd: RawFd) -> Error {
    let os = std::io::Error::last_os_error();
    if os.raw_os_error() == Some(libc::ESRCH) {
        return Error::new(
            crate::error::ErrorKind::Remote,
            format!("pidfd_getfd(pid {pid}, fd {fd}): the process is exiting or gone"),
        );
    }
    Error::from_io(format!("pidfd_getfd(pid {pid}, fd {fd})"), os)
}

/// Whether this process may duplicate the descriptors of process `pid` with `take_fd`, asked
/// without taking one: pidfd_getfd checks the permission (ptrace's, which process_vm_readv
/// needs too) before it looks the descriptor up, so a number no process holds fails with
/// EBADF where the permission holds, and with EPERM where it does not (ENOSYS before Linux
/// 5.6, ESRCH for a process that is gone).
pub(crate) fn may_take_fds(pid: u32) -> bool {
    // SAFETY: pidfd_open takes a pid and flags and returns a descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return false;
    }
    // SAFETY: pidfd_open returned a fresh descriptor that we own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    // SAFETY: as in take_fd; the number is above any descriptor table's size.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), i32::MAX, 0) };
    if got >= 0 {
        // SAFETY: a fresh descriptor that we own (not expected: nobody holds that number).
        drop(unsafe { OwnedFd::from_raw_fd(got as RawFd) });
        return true;
    }
    io::Error::last_os_error().raw_os_error() == Some(libc::EBADF)
}

/// Duplicates a descriptor of this process (a same-process peer's segment).
pub(crate) fn dup(fd: RawFd) -> Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC returns a new descriptor or -1; fd is checked by the kernel.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if new < 0 {
        return Err(Error::last_os(format!("dup of segment descriptor {fd}")));
    }
    // SAFETY: a fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// A doorbell made of two futex words, which may lie in memory shared between processes: the
/// bell, which a ring moves and a sleeper sleeps on, and the number of sleepers, so that a
/// ring writes nothing (and the bell's cache line stays put) while nobody sleeps. A ring after
/// `prepare_sleep` always wakes the sleeper: the ringer publishes its change and then looks
/// at the sleepers; the sleeper counts itself and then looks at the change; a fence on each
/// side (or a SeqCst change, see `ring_after_seqcst`) makes at least one of them see the
/// other's write.
#[derive(Clone, Copy)]
pub(crate) struct FutexBell<'a> {
    pub bell: &'a AtomicU32,
    pub sleepers: &'a AtomicU32,
}

impl FutexBell<'_> {
    /// Wakes the sleepers, if any, after a change the caller published in any way.
    #[inline]
    pub(crate) fn ring(&self) {
        fence(Ordering::SeqCst);
        self.ring_after_seqcst();
    }

    /// Wakes the sleepers, if any, after a change the caller made with a SeqCst store or
    /// read-modify-write: that change and this look at the sleepers are then both in the one
    /// order of SeqCst operations, which `ring`'s fence gives otherwise (a fence is not free
    /// on a signal's critical path).
    #[inline]
    pub(crate) fn ring_after_seqcst(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            self.bell.fetch_add(1, Ordering::SeqCst);
            futex_wake_all(self.bell);
        }
    }

    /// Counts the caller as a sleeper and returns the bell's value to sleep on. The caller
    /// looks for its change once more, then calls `sleep` or `cancel_sleep`.
    pub(crate) fn prepare_sleep(&self) -> u32 {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        // Pairs with the ringer's fence or SeqCst change: the caller's next look cannot move
        // before the count.
        fence(Ordering::SeqCst);
        self.bell.load(Ordering::SeqCst)
    }

    pub(crate) fn cancel_sleep(&self) {
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Sleeps until a ring after `prepare_sleep` returned `seen`, or `timeout`, and stops
    /// counting as a sleeper.
    pub(crate) fn sleep(&self, seen: u32, timeout: Duration) {
        futex_wait(self.bell, seen, timeout);
        self.cancel_sleep();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process that has exited (a zombie, not reaped yet) answers pidfd_getfd with ESRCH
    /// before anyone is told it ended: that is a peer gone (ncclRemoteError), not a fault of
    /// this system.
    #[test]
    fn taking_a_descriptor_of_an_exited_process_is_a_remote_error() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            let state = stat.rsplit(')').next().unwrap().split_whitespace().next();
            if state == Some("Z") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the child never exited"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let e = take_fd(pid, 0).expect_err("an exited process has no descriptors");
        child.wait().unwrap();
        assert_eq!(e.kind, crate::error::ErrorKind::Remote, "{}", e.msg);
        assert!(e.msg.contains("exiting or gone"), "{}", e.msg);
    }

    /// A buffer's huge pages are advised the first time it comes, collapsed the second, and
    /// left alone after; a range reaching into pages not seen before starts over for them.
    #[test]
    fn regions_are_collapsed_when_they_come_again() {
        let mut r = Regions::default();
        let (a, b) = (16 * HUGE_PAGE, 20 * HUGE_PAGE);
        assert_eq!(r.sighted(a, b), Some(false));
        assert_eq!(r.sighted(a, b), Some(true));
        assert_eq!(r.sighted(a, b), None);
        assert_eq!(r.sighted(a + HUGE_PAGE, b - HUGE_PAGE), None);
        // Grown by two pages: advised, then collapsed as a whole.
        assert_eq!(r.sighted(a, b + 2 * HUGE_PAGE), Some(false));
        assert_eq!(r.sighted(a, b + 2 * HUGE_PAGE), Some(true));
        assert_eq!(r.sighted(b, b + 2 * HUGE_PAGE), None);
        // Another buffer is on its own.
        assert_eq!(r.sighted(64 * HUGE_PAGE, 65 * HUGE_PAGE), Some(false));
        assert_eq!(r.sighted(a, b), None);
    }

    fn affinity() -> Vec<u32> {
        cpus_allowed()
    }

    /// Restricts the calling thread to `cpus`.
    fn restrict(cpus: &[u32]) {
        // SAFETY: cpu_set_t is plain bits; zeroed is an empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &c in cpus {
            // SAFETY: c is a CPU of a mask, below CPU_SETSIZE.
            unsafe { libc::CPU_SET(c as usize, &mut set) };
        }
        // SAFETY: a valid set for the calling thread.
        let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
        assert_eq!(r, 0);
    }

    fn cpu() -> u32 {
        // SAFETY: no preconditions.
        unsafe { libc::sched_getcpu() as u32 }
    }

    /// A thread sent to the n-th CPU of its mask (counted round) lands there and keeps its
    /// mask.
    #[test]
    fn move_to_nth_cpu_lands_there_and_keeps_the_mask() {
        std::thread::spawn(|| {
            let mask = affinity();
            let Some(k) = mask.iter().position(|&c| c != cpu()) else {
                assert_eq!(move_to_nth_cpu(1), None, "one CPU: nowhere to go");
                return;
            };
            // Counted round: k + the number of CPUs is k. (The scheduler may have put the
            // thread there meanwhile, when other tests run: then it need not move.)
            let to = move_to_nth_cpu(k + mask.len());
            assert!(
                to == Some(mask[k]) || (to.is_none() && cpu() == mask[k]),
                "sent to {}, moved to {to:?}, runs on {}",
                mask[k],
                cpu()
            );
            assert_eq!(affinity(), mask, "the thread's mask was not given back");
        })
        .join()
        .unwrap();
    }

    /// Held for a sleep, a thread may run only on its CPU; told to avoid that one, on the
    /// rest of its mask (and it moves off at once); with nothing left, or a mask of one CPU,
    /// nothing changes. The mask comes back whole when the hold ends.
    #[test]
    fn a_thread_held_for_a_sleep_stays_put_or_keeps_off_the_cpus_to_avoid() {
        std::thread::spawn(|| {
            let mask = affinity();
            let here = cpu();
            if mask.len() < 2 {
                assert!(
                    hold_for_sleep(here, &[]).is_none(),
                    "one CPU: nothing to narrow"
                );
                return;
            }
            {
                let _held = hold_for_sleep(here, &[]).expect("held on its CPU");
                assert_eq!(affinity(), vec![here]);
            }
            assert_eq!(affinity(), mask);
            let rest: Vec<u32> = mask.iter().copied().filter(|&c| c != here).collect();
            {
                let _held = hold_for_sleep(here, &[here]).expect("kept off its CPU");
                assert_eq!(affinity(), rest);
                assert_ne!(cpu(), here, "still on the CPU to avoid");
            }
            assert_eq!(affinity(), mask);
            assert!(
                hold_for_sleep(cpu(), &mask).is_none(),
                "every CPU to be avoided"
            );
            assert_eq!(affinity(), mask);
            restrict(&mask[..1]);
            assert!(hold_for_sleep(mask[0], &[]).is_none(), "a mask of one CPU");
            assert_eq!(affinity(), mask[..1].to_vec());
            restrict(&mask);
        })
        .join()
        .unwrap();
    }

    /// A thread moves to another CPU it may use, lands there, and keeps its own mask; with
    /// every other CPU to be avoided it stays.
    #[test]
    fn move_off_cpu_lands_elsewhere_and_keeps_the_mask() {
        let mask = affinity();
        // SAFETY: no preconditions.
        let here = unsafe { libc::sched_getcpu() } as u32;
        let others: Vec<u32> = mask.iter().copied().filter(|&c| c != here).collect();
        assert_eq!(
            move_off_cpu(here, &others, |_| panic!(
                "nowhere to go, nothing to announce"
            )),
            None,
            "every other CPU was to be avoided"
        );
        if others.is_empty() {
            eprintln!("one usable CPU: nowhere to move");
            return;
        }
        let mut announced = None;
        let to = move_off_cpu(here, &[], |c| announced = Some(c)).expect("a CPU to move to");
        assert_ne!(to, here);
        assert_eq!(
            announced,
            Some(to),
            "the destination is told before the move"
        );
        assert!(
            mask.contains(&to),
            "moved to {to}, outside the mask {mask:?}"
        );
        // SAFETY: no preconditions. The thread may be moved again at once, but only within
        // the mask; right after the call it is where it was sent in all but rare cases.
        let now = unsafe { libc::sched_getcpu() } as u32;
        assert!(mask.contains(&now));
        assert_eq!(affinity(), mask, "the thread's mask was not given back");
    }

    /// pidfd_getfd on a child process: the duplicate reaches the child's memfd (what a peer
    /// does with a registered VMM buffer's descriptor). The child is a fork that waits.
    #[test]
    fn take_fd_duplicates_another_process_descriptor() {
        let fd = memfd("take-fd", 4096).unwrap();
        let m = Mapping::map(fd.as_raw_fd(), 4096).unwrap();
        // SAFETY: the mapping is 4096 bytes.
        unsafe { *m.ptr().add(100) = 7 };
        // SAFETY: the child only sleeps and exits; it touches nothing of the parent's state.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork failed");
        if child == 0 {
            // SAFETY: async-signal-safe calls only.
            unsafe {
                libc::sleep(5);
                libc::_exit(0)
            };
        }
        // Our own descriptor number is the child's too (inherited across fork).
        let got = take_fd(child as u32, fd.as_raw_fd());
        // SAFETY: the child is ours to stop and reap.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        let dup = got.expect("pidfd_getfd of a child's descriptor");
        let n = Mapping::map(dup.as_raw_fd(), 4096).unwrap();
        // SAFETY: 4096 bytes mapped.
        assert_eq!(unsafe { *n.ptr().add(100) }, 7);
        // A descriptor the child does not have is an error, not a wrong file.
        assert!(take_fd(std::process::id(), 1_000_000).is_err());
    }

    #[test]
    fn memfd_maps_shared_between_two_mappings() {
        let fd = memfd("test", 8192).unwrap();
        let a = Mapping::map(fd.as_raw_fd(), 8192).unwrap();
        let b = Mapping::map(fd.as_raw_fd(), 8192).unwrap();
        // SAFETY: both mappings are 8192 bytes long.
        unsafe {
            *a.ptr().add(4000) = 42;
            assert_eq!(*b.ptr().add(4000), 42);
        }
    }

    #[test]
    fn fd_passes_over_a_unix_socket() {
        let (x, y) = UnixStream::pair().unwrap();
        let fd = memfd("pass", 4096).unwrap();
        let a = Mapping::map(fd.as_raw_fd(), 4096).unwrap();
        send_fd(&x, fd.as_raw_fd()).unwrap();
        let got = recv_fd(&y).unwrap();
        let b = Mapping::map(got.as_raw_fd(), 4096).unwrap();
        // SAFETY: both mappings are 4096 bytes long.
        unsafe {
            *a.ptr() = 7;
            assert_eq!(*b.ptr(), 7);
        }
    }

    #[test]
    fn cma_reads_own_memory_and_watch_sees_self_alive() {
        let src = vec![1u8, 2, 3, 4, 5];
        let mut dst = vec![0u8; 5];
        // SAFETY: dst holds 5 bytes.
        unsafe {
            cma_read(
                std::process::id(),
                dst.as_mut_ptr(),
                src.as_ptr() as usize,
                5,
            )
        }
        .unwrap();
        assert_eq!(src, dst);
        assert!(ProcessWatch::new(std::process::id()).alive());
    }

    #[test]
    fn watch_sees_a_child_exit() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let w = ProcessWatch::new(child.id());
        child.wait().unwrap();
        assert!(!w.alive());
    }

    #[test]
    fn futex_wait_returns_on_mismatch_and_on_timeout() {
        let w = AtomicU32::new(5);
        let t = std::time::Instant::now();
        futex_wait(&w, 4, Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(1));
        futex_wait(&w, 5, Duration::from_millis(20));
        assert!(t.elapsed() >= Duration::from_millis(15));
        futex_wake_all(&w);
    }
}
