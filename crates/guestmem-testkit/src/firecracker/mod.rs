//! A stand-in for Firecracker restoring a snapshot with a `Uffd` memory backend, for
//! testing and measuring page servers without Firecracker. It does what Firecracker's
//! `docs/snapshotting/handling-page-faults-on-snapshot-resume.md` describes and its
//! `persist.rs` does:
//!
//! 1. map each region as fresh private anonymous memory (with no THP advice either way, as
//!    Firecracker maps it), or hugetlb memory for a guest with huge pages;
//! 2. open a userfaultfd (non-blocking, close-on-exec; with `UFFD_FEATURE_EVENT_REMOVE` when
//!    the VM has a balloon) and register every region for missing faults;
//! 3. connect to the server's socket and send, in one `sendmsg` with the descriptor as
//!    `SCM_RIGHTS` (vmm-sys-util's `send_with_fd`, which Firecracker uses), the JSON array of
//!    `{"base_host_virt_addr", "size", "offset", "page_size", "page_size_kib"}`, regions
//!    laid end to end in the memory file (`page_size_kib` holding bytes, as Firecracker's);
//! 4. keep the socket open while it runs.
//!
//! Then its "vCPUs" (threads) read guest memory; [`Standin::remove`] is the balloon's
//! `MADV_DONTNEED`. It depends on no guestmem crate: what it checks a server did, it reads
//! from the kernel itself (the words, `/proc/self/smaps`).
//!
//! [`vmm`] drives a real Firecracker process instead (`../shared/firecracker`).

mod child;
pub mod vmm;

pub use child::{child_main, vm_child, ChildDoes, CHILD_REFUSED};

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Instant;

use linux_raw_sys::general as uapi;
use linux_raw_sys::ioctl as nr;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// The page the stand-in's threads step by.
pub const PAGE: usize = 4096;

/// One ioctl on a userfaultfd.
///
/// # Safety
/// `arg` must be the uapi struct `req` names (the kernel reads and writes that struct through
/// the pointer), and every address in it one the call may use: a range this descriptor has
/// registered, a source buffer live and readable for its whole length.
pub unsafe fn uffd_ioctl<T>(fd: &OwnedFd, req: u32, arg: &mut T) -> io::Result<()> {
    // SAFETY: the caller's contract: `arg` is the struct `req` expects, borrowed for the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg as *mut T) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A non-blocking, close-on-exec userfaultfd, its API enabled with `features`.
pub fn uffd_open(features: u64) -> io::Result<OwnedFd> {
    // SAFETY: flags only.
    let raw = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let uffd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    let mut api = uapi::uffdio_api {
        api: uapi::UFFD_API as u64,
        features,
        ioctls: 0,
    };
    // SAFETY: a uffdio_api for UFFDIO_API; it names no memory.
    unsafe { uffd_ioctl(&uffd, nr::UFFDIO_API, &mut api) }?;
    Ok(uffd)
}

/// Registers `start..start + len` for missing faults.
///
/// # Safety
/// The range must be memory of this process that nothing else relies on being served
/// otherwise: a thread touching it waits until a server fills it.
pub unsafe fn uffd_register_missing(uffd: &OwnedFd, start: u64, len: u64) -> io::Result<()> {
    let mut reg = uapi::uffdio_register {
        range: uapi::uffdio_range { start, len },
        mode: u64::from(uapi::UFFDIO_REGISTER_MODE_MISSING),
        ioctls: 0,
    };
    // SAFETY: a uffdio_register for UFFDIO_REGISTER, naming memory the caller vouches for;
    // the kernel checks the range is mapped.
    unsafe { uffd_ioctl(uffd, nr::UFFDIO_REGISTER, &mut reg) }
}

/// A private anonymous mapping the stand-in owns: unmapped on drop.
#[derive(Debug)]
struct Region {
    addr: *mut u8,
    len: usize,
    /// Where its bytes are in the memory file.
    offset: u64,
}

// SAFETY: the mapping is plain memory owned by this value; threads only read it through
// volatile loads, and the kernel fills it.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// `len` bytes, on hugetlb pages of `huge` bytes when given.
    fn map(len: usize, huge: Option<usize>, offset: u64) -> io::Result<Region> {
        // As Firecracker maps guest memory: anonymous memory without a reservation, hugetlb
        // memory with one (its pages are taken from the pool at once, never missing later).
        let flags = match huge {
            None => libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            Some(h) => {
                libc::MAP_PRIVATE
                    | libc::MAP_ANONYMOUS
                    | libc::MAP_HUGETLB
                    | ((h.trailing_zeros() as libc::c_int) << libc::MAP_HUGE_SHIFT)
            }
        };
        // SAFETY: a fresh anonymous mapping at an address the kernel chooses; nothing of
        // ours is replaced.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Region {
            addr: p as *mut u8,
            len,
            offset,
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; nothing borrows it past `self`.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// One region as Firecracker's handshake describes it (its field names are the JSON's).
#[derive(Debug, Clone, serde::Serialize)]
pub struct WireRegion {
    /// Where the region is in this process.
    pub base_host_virt_addr: u64,
    /// Bytes.
    pub size: usize,
    /// Where its bytes are in the memory file.
    pub offset: u64,
    /// Page size, bytes.
    pub page_size: usize,
    /// The same, under the name Firecracker keeps for older handlers (bytes, despite it).
    pub page_size_kib: usize,
}

/// A restored "VM": its memory, registered with a userfaultfd a server now holds.
pub struct Standin {
    /// Until [`Standin::disconnect`], which closes it as a VM's exit does.
    uffd: Option<OwnedFd>,
    regions: Vec<Region>,
    sock: Option<UnixStream>,
    /// The page size its memory has (and its handshake declares).
    page: usize,
}

/// One full read of guest memory.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReadRun {
    /// From the first thread's start to the last thread's end, seconds.
    pub seconds: f64,
    /// Each thread's own seconds.
    pub thread_seconds: Vec<f64>,
    /// XOR of every word read (keeps the reads).
    pub digest: u64,
}

impl Standin {
    /// Maps and registers `sizes` (each a multiple of 4 KiB) and opens the userfaultfd, with
    /// remove events when `balloon`. Sends nothing yet.
    pub fn new(sizes: &[usize], balloon: bool) -> io::Result<Standin> {
        let features = if balloon {
            u64::from(uapi::UFFD_FEATURE_EVENT_REMOVE)
        } else {
            0
        };
        Standin::with_features(sizes, features)
    }

    /// As [`Standin::new`], with the userfaultfd features given (`UFFD_FEATURE_*`): for peers
    /// that ask for more than Firecracker does (fork events, say).
    pub fn with_features(sizes: &[usize], features: u64) -> io::Result<Standin> {
        Standin::build(sizes, features, None)
    }

    /// As [`Standin::new`] (no balloon), with private anonymous hugetlb memory of pages of
    /// `page_bytes` (2 MiB or 1 GiB), as Firecracker maps a guest with `huge_pages`; its
    /// handshake declares that page size. The hugetlb pool must hold the pages.
    pub fn huge(sizes: &[usize], page_bytes: usize) -> io::Result<Standin> {
        Standin::build(sizes, 0, Some(page_bytes))
    }

    fn build(sizes: &[usize], features: u64, huge: Option<usize>) -> io::Result<Standin> {
        let uffd = uffd_open(features)?;
        let mut regions = Vec::new();
        let mut offset = 0u64;
        for &size in sizes {
            let r = Region::map(size, huge, offset)?;
            // SAFETY: the stand-in's own fresh mapping, touched only by its readers, which
            // a server fills.
            unsafe { uffd_register_missing(&uffd, r.addr as u64, size as u64) }?;
            regions.push(r);
            offset += size as u64;
        }
        Ok(Standin {
            uffd: Some(uffd),
            regions,
            sock: None,
            page: huge.unwrap_or(PAGE),
        })
    }

    /// The handshake's regions, as Firecracker builds them.
    pub fn wire_regions(&self) -> Vec<WireRegion> {
        self.regions
            .iter()
            .map(|r| WireRegion {
                base_host_virt_addr: r.addr as u64,
                size: r.len,
                offset: r.offset,
                page_size: self.page,
                page_size_kib: self.page,
            })
            .collect()
    }

    /// Connects to `socket` and sends the handshake as Firecracker does.
    pub fn connect(&mut self, socket: &Path) -> io::Result<()> {
        let json = serde_json::to_string(&self.wire_regions()).expect("serialises");
        self.send(socket, json.as_bytes(), true)
    }

    /// Connects to `socket` and sends `bytes`, with the userfaultfd when `with_fd`: for
    /// handshakes that go wrong.
    pub fn send(&mut self, socket: &Path, bytes: &[u8], with_fd: bool) -> io::Result<()> {
        let s = UnixStream::connect(socket)?;
        if with_fd {
            let uffd = self.uffd.as_ref().ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotConnected, "its userfaultfd was closed")
            })?;
            s.send_with_fd(bytes, uffd.as_raw_fd())
                .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
        } else {
            std::io::Write::write_all(&mut &s, bytes)?;
        }
        self.sock = Some(s);
        Ok(())
    }

    /// Connects to `socket` and sends `bytes` with `fd` (not our userfaultfd): a peer that
    /// sends the wrong descriptor.
    pub fn send_other_fd(
        &mut self,
        socket: &Path,
        bytes: &[u8],
        fd: &impl AsRawFd,
    ) -> io::Result<()> {
        let s = UnixStream::connect(socket)?;
        s.send_with_fd(bytes, fd.as_raw_fd())
            .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
        self.sock = Some(s);
        Ok(())
    }

    /// A second handle on the socket to the server (for a test that writes more to it).
    pub fn socket_clone(&self) -> io::Result<UnixStream> {
        self.sock
            .as_ref()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))?
            .try_clone()
    }

    /// Goes as a VM's process does when it exits, to a server: its userfaultfd closed,
    /// then its socket (a process's memory and descriptors go before its socket's peer sees
    /// it hang up). Its memory stays mapped and readable (pages a server brought in), in
    /// this process.
    pub fn disconnect(&mut self) {
        self.uffd = None;
        self.sock = None;
    }

    /// Unmaps all its memory, registered or not (a VM letting go of it); it has none
    /// after.
    pub fn unmap(&mut self) {
        self.regions.clear();
    }

    /// Closes the socket only, holding its userfaultfd: a VM that hangs up and runs on.
    pub fn hang_up(&mut self) {
        self.sock = None;
    }

    /// Total bytes of guest memory.
    pub fn size(&self) -> usize {
        self.regions.iter().map(|r| r.len).sum()
    }

    /// Reads one word of every page with `threads` threads, each a contiguous share of all
    /// regions (in order), as vCPUs would touch memory: every first read is a fault the
    /// server must answer.
    pub fn read_all(&self, threads: usize) -> ReadRun {
        // SAFETY: the ranges are this stand-in's own mappings, alive while `self` is.
        unsafe { read_ranges(&self.ranges(), threads) }
    }

    /// Each region's (host address, length), in order.
    fn ranges(&self) -> Vec<(usize, usize)> {
        self.regions
            .iter()
            .map(|r| (r.addr as usize, r.len))
            .collect()
    }

    /// The (region, offset) of byte `at` of guest memory, regions in order.
    fn locate(&self, mut at: usize) -> (&Region, usize) {
        for r in &self.regions {
            if at < r.len {
                return (r, at);
            }
            at -= r.len;
        }
        panic!("offset past guest memory");
    }

    /// The word at byte `at` of guest memory (a fault the server answers if not yet in).
    pub fn word(&self, at: usize) -> u64 {
        assert!(
            at.is_multiple_of(8) && at + 8 <= self.size(),
            "a word inside guest memory"
        );
        word_at(&self.ranges(), at)
    }

    /// Bytes of guest memory resident now (smaps `Rss`).
    pub fn resident(&self) -> io::Result<u64> {
        Ok(smaps_of(&self.ranges())?.0)
    }

    /// Bytes of guest memory transparent huge pages map now (smaps `AnonHugePages`).
    pub fn anon_huge(&self) -> io::Result<u64> {
        Ok(smaps_of(&self.ranges())?.1)
    }

    /// Compares all of guest memory with `memory_file`; the first difference, if any, is
    /// named by its offset.
    pub fn compare(&self, memory_file: &Path) -> io::Result<Result<(), String>> {
        use std::io::Read;
        let mut f = std::fs::File::open(memory_file)?;
        let mut buf = vec![0u8; 1 << 20];
        for r in &self.regions {
            let mut done = 0usize;
            while done < r.len {
                let n = buf.len().min(r.len - done);
                f.read_exact(&mut buf[..n])?;
                for (k, want) in buf[..n].chunks_exact(8).enumerate() {
                    let at = done + k * 8;
                    // SAFETY: at + 8 <= r.len: inside the mapping; volatile, no reference.
                    let got = unsafe { (r.addr.add(at) as *const u64).read_volatile() };
                    let want = u64::from_ne_bytes(want.try_into().expect("8 bytes"));
                    if got != want {
                        return Ok(Err(format!(
                            "memory-file offset {:#x}: memory holds {got:#018x}, the file {want:#018x}",
                            r.offset + at as u64
                        )));
                    }
                }
                done += n;
            }
        }
        Ok(Ok(()))
    }

    /// The balloon inflating: `MADV_DONTNEED` over `len` bytes at byte `at` of guest memory
    /// (one region). With remove events on, the server hears of it before the pages go.
    pub fn remove(&self, at: usize, len: usize) -> io::Result<()> {
        let (r, off) = self.locate(at);
        assert!(
            off + len <= r.len && off.is_multiple_of(PAGE),
            "a page-aligned range of one region"
        );
        // SAFETY: a page-aligned range inside the stand-in's own mapping (checked above);
        // MADV_DONTNEED drops its pages, which read back as the server (or zero) gives them.
        let ret = unsafe {
            libc::madvise(
                r.addr.add(off) as *mut libc::c_void,
                len,
                libc::MADV_DONTNEED,
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Unregisters every region: threads waiting on a fault no server will answer are
    /// woken (and read zero pages from then on). After [`Standin::disconnect`] it does
    /// nothing: the userfaultfd is closed, and the regions stay registered until the
    /// server closes its own.
    pub fn release(&self) -> io::Result<()> {
        // Closed: the server's descriptor is the registration's last (see `disconnect`).
        let Some(uffd) = &self.uffd else {
            return Ok(());
        };
        for r in &self.regions {
            let mut range = uapi::uffdio_range {
                start: r.addr as u64,
                len: r.len as u64,
            };
            // SAFETY: a uffdio_range for UFFDIO_UNREGISTER: one of this stand-in's own
            // mappings.
            unsafe { uffd_ioctl(uffd, nr::UFFDIO_UNREGISTER, &mut range) }?;
        }
        Ok(())
    }
}

impl Drop for Standin {
    fn drop(&mut self) {
        // Nothing may stay registered over memory about to be unmapped by a drop that a
        // server could still fill.
        let _ = self.release();
    }
}

/// Reads one word of every page of `ranges` (host address, length; in order) with
/// `threads` threads, each a contiguous share: every first read of a registered page is a
/// fault its server must answer.
///
/// # Safety
/// Every range must stay mapped and readable for the call.
pub unsafe fn read_ranges(ranges: &[(usize, usize)], threads: usize) -> ReadRun {
    let pages = ranges.iter().map(|r| r.1).sum::<usize>() / PAGE;
    let threads = threads.clamp(1, pages.max(1));
    let share = pages.div_ceil(threads);
    let gate = std::sync::Barrier::new(threads + 1);
    let t0 = std::sync::OnceLock::new();
    let results: Vec<(f64, u64, Instant)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|i| {
                let gate = &gate;
                s.spawn(move || {
                    gate.wait();
                    let start = Instant::now();
                    let mut x = 0u64;
                    for p in i * share..((i + 1) * share).min(pages) {
                        x ^= word_at(ranges, p * PAGE);
                    }
                    (start.elapsed().as_secs_f64(), x, Instant::now())
                })
            })
            .collect();
        let _ = t0.set(Instant::now());
        gate.wait();
        hs.into_iter().map(|h| h.join().expect("reader")).collect()
    });
    let t0 = *t0.get().expect("set");
    let end = results.iter().map(|r| r.2).max().unwrap_or(t0);
    ReadRun {
        seconds: end.saturating_duration_since(t0).as_secs_f64(),
        thread_seconds: results.iter().map(|r| r.0).collect(),
        digest: results.iter().fold(0, |a, r| a ^ r.1),
    }
}

/// The word at byte `at` of `ranges` laid end to end.
fn word_at(ranges: &[(usize, usize)], mut at: usize) -> u64 {
    for &(start, len) in ranges {
        if at < len {
            // SAFETY: at + 8 <= len (8-aligned at, ranges of whole pages): inside a range
            // that stays mapped (read_ranges' contract, or the stand-in's own mappings);
            // volatile, no Rust reference to it.
            return unsafe { ((start + at) as *const u64).read_volatile() };
        }
        at -= len;
    }
    panic!("offset past the ranges");
}

/// The `Rss` and `AnonHugePages` bytes of the mappings of this process that start inside
/// `ranges` (each stand-in region is a mapping of its own), from `/proc/self/smaps`.
fn smaps_of(ranges: &[(usize, usize)]) -> io::Result<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/smaps")?;
    let (mut rss, mut huge) = (0u64, 0u64);
    let mut inside = false;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if let Some((lo, _)) = first.split_once('-') {
            if !first.ends_with(':') {
                let start = usize::from_str_radix(lo, 16).unwrap_or(usize::MAX);
                inside = ranges.iter().any(|&(s, l)| start >= s && start < s + l);
                continue;
            }
        }
        if !inside {
            continue;
        }
        let mut kib = || {
            words
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                << 10
        };
        match first {
            "Rss:" => rss += kib(),
            "AnonHugePages:" => huge += kib(),
            _ => {}
        }
    }
    Ok((rss, huge))
}

/// The word at byte `at` of a test memory file ([`memory_file`]): a mix of the offset,
/// never zero.
pub fn word(at: u64) -> u64 {
    let mut x = at.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef;
    x ^= x >> 29;
    x | 1
}

const MIB: usize = 1 << 20;

/// A memory file `memory` in `dir` of `size` bytes (whole MiB), each word [`word`] of its
/// offset; the MiB at `hole` (if any) is left a hole (reads as zero).
pub fn memory_file(dir: &Path, size: usize, hole: Option<usize>) -> std::path::PathBuf {
    use std::io::{Seek, SeekFrom, Write};
    let p = dir.join("memory");
    let mut f = std::fs::File::create(&p).expect("create the memory file");
    let mut buf = vec![0u8; MIB];
    for m in 0..size / MIB {
        if Some(m * MIB) == hole {
            f.set_len(((m + 1) * MIB) as u64).expect("extend");
            f.seek(SeekFrom::Start(((m + 1) * MIB) as u64))
                .expect("seek");
            continue;
        }
        for (k, c) in buf.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&word((m * MIB + k * 8) as u64).to_ne_bytes());
        }
        f.write_all(&buf).expect("write the memory file");
    }
    f.set_len(size as u64).expect("size");
    p
}

/// Why this machine cannot run a page server's tests, if it cannot (no userfaultfd).
pub fn missing_uffd() -> Option<String> {
    // SAFETY: flags only; the descriptor is closed at once.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    if fd < 0 {
        return Some(format!(
            "userfaultfd unavailable ({}): needs root or vm.unprivileged_userfaultfd",
            io::Error::last_os_error()
        ));
    }
    // SAFETY: our own descriptor, closed once.
    unsafe { libc::close(fd as i32) };
    None
}
