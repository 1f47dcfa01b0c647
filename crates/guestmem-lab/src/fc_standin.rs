//! A stand-in for Firecracker restoring a snapshot with a `Uffd` memory backend, for
//! testing and measuring page servers (`guestmem serve-uffd`, the lab's Firecracker-style
//! peer) without Firecracker. It does what Firecracker's `docs/snapshotting/
//! handling-page-faults-on-snapshot-resume.md` describes and its `persist.rs` does:
//!
//! 1. map each region as fresh private anonymous memory;
//! 2. open a userfaultfd (non-blocking, close-on-exec; with `UFFD_FEATURE_EVENT_REMOVE` when
//!    the VM has a balloon) and register every region for missing faults;
//! 3. connect to the server's socket and send, in one `sendmsg` with the descriptor as
//!    `SCM_RIGHTS` (vmm-sys-util's `send_with_fd`, which Firecracker uses), the JSON array of
//!    `{"base_host_virt_addr", "size", "offset", "page_size", "page_size_kib"}`, regions
//!    laid end to end in the memory file;
//! 4. keep the socket open while it runs.
//!
//! Then its "vCPUs" (threads) read guest memory; [`Standin::remove`] is the balloon's
//! `MADV_DONTNEED`. A lab instrument, not library API.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Instant;

use guestmem::mmap::{Advice, Mapping};
use linux_raw_sys::general as uapi;
use linux_raw_sys::ioctl as nr;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::uffd_raw::{self, ioctl};

/// The page the stand-in's threads step by.
pub const PAGE: usize = 4096;

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
    uffd: OwnedFd,
    regions: Vec<(Mapping, u64)>,
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

    /// As [`Standin::new`] (no balloon), with private anonymous hugetlb memory of `size`
    /// pages, as Firecracker maps a guest with `huge_pages`; its handshake declares that
    /// page size. The hugetlb pool must hold the pages.
    pub fn huge(sizes: &[usize], size: guestmem::HugePageSize) -> io::Result<Standin> {
        Standin::build(sizes, 0, Some(size))
    }

    fn build(
        sizes: &[usize],
        features: u64,
        huge: Option<guestmem::HugePageSize>,
    ) -> io::Result<Standin> {
        let uffd = uffd_raw::open(features)?;
        let mut regions = Vec::new();
        let mut offset = 0u64;
        for &size in sizes {
            let m = match huge {
                Some(h) => Mapping::anonymous_huge(size, h).map_err(|e| e.into_io())?,
                // Firecracker gives guest memory no THP advice either way (its VMA shows
                // neither `hg` nor `nh` in smaps' VmFlags, v1.17): with THP in `madvise`
                // mode it faults 4 KiB pages, and MADV_COLLAPSE may still collapse it.
                None => Mapping::anonymous(size).map_err(|e| e.into_io())?,
            };
            uffd_raw::register_missing(&uffd, m.as_ptr() as u64, size as u64)?;
            regions.push((m, offset));
            offset += size as u64;
        }
        Ok(Standin {
            uffd,
            regions,
            sock: None,
            page: huge.map_or(PAGE, |h| h.bytes() as usize),
        })
    }

    /// The handshake's regions, as Firecracker builds them.
    pub fn wire_regions(&self) -> Vec<WireRegion> {
        self.regions
            .iter()
            .map(|(m, off)| WireRegion {
                base_host_virt_addr: m.as_ptr() as u64,
                size: m.len(),
                offset: *off,
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
            s.send_with_fd(bytes, self.uffd.as_raw_fd())
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

    /// Closes the socket: to a server, the VM has gone.
    pub fn disconnect(&mut self) {
        self.sock = None;
    }

    /// Total bytes of guest memory.
    pub fn size(&self) -> usize {
        self.regions.iter().map(|(m, _)| m.len()).sum()
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
            .map(|(m, _)| (m.as_ptr() as usize, m.len()))
            .collect()
    }

    /// The (region, offset) of byte `at` of guest memory, regions in order.
    fn locate(&self, mut at: usize) -> (&Mapping, usize) {
        for (m, _) in &self.regions {
            if at < m.len() {
                return (m, at);
            }
            at -= m.len();
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
    pub fn resident(&self) -> Result<u64, guestmem::inspect::InspectError> {
        Ok(guestmem::inspect::inspect_host_ranges(&self.host_ranges())?.resident)
    }

    fn host_ranges(&self) -> Vec<guestmem::inspect::HostRange> {
        self.ranges()
            .into_iter()
            .map(|(start, len)| guestmem::inspect::HostRange {
                start: start as u64,
                len: len as u64,
                huge_align: 2 << 20,
            })
            .collect()
    }

    /// Bytes of guest memory transparent huge pages map now (smaps `AnonHugePages`).
    pub fn anon_huge(&self) -> Result<u64, guestmem::inspect::InspectError> {
        Ok(guestmem::inspect::inspect_host_ranges(&self.host_ranges())?.huge)
    }

    /// Compares all of guest memory with `memory_file`; the first difference, if any, is
    /// named by its offset.
    pub fn compare(&self, memory_file: &Path) -> io::Result<Result<(), String>> {
        use std::io::Read;
        let mut f = std::fs::File::open(memory_file)?;
        let mut buf = vec![0u8; 1 << 20];
        for (m, off) in &self.regions {
            let mut done = 0usize;
            while done < m.len() {
                let n = buf.len().min(m.len() - done);
                f.read_exact(&mut buf[..n])?;
                for (k, want) in buf[..n].chunks_exact(8).enumerate() {
                    let at = done + k * 8;
                    // SAFETY: at + 8 <= m.len(): inside the mapping; volatile, no reference.
                    let got = unsafe { (m.as_ptr().add(at) as *const u64).read_volatile() };
                    let want = u64::from_ne_bytes(want.try_into().expect("8 bytes"));
                    if got != want {
                        return Ok(Err(format!(
                            "memory-file offset {:#x}: memory holds {got:#018x}, the file {want:#018x}",
                            off + at as u64
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
        let (m, off) = self.locate(at);
        m.advise(off, len, Advice::DontNeed)
            .map_err(|e| e.into_io())
    }

    /// Unregisters every region: threads waiting on a fault no server will answer are
    /// woken (and read zero pages from then on).
    pub fn release(&self) -> io::Result<()> {
        for (m, _) in &self.regions {
            let mut r = uapi::uffdio_range {
                start: m.as_ptr() as u64,
                len: m.len() as u64,
            };
            // SAFETY: a uffdio_range for UFFDIO_UNREGISTER: one of this stand-in's own
            // mappings.
            unsafe { ioctl(&self.uffd, nr::UFFDIO_UNREGISTER, &mut r) }?;
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
