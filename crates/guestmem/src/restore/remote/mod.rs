//! A page server for Firecracker's snapshot restores: the lazy restore's engine serving
//! another process's memory.
//!
//! Firecracker, told to restore with a `Uffd` memory backend, maps fresh private anonymous
//! memory, registers it with a userfaultfd it opens, connects to a Unix socket and sends one
//! message: the descriptor (`SCM_RIGHTS`) and a JSON array with one object per region,
//! `{"base_host_virt_addr", "size", "offset", "page_size"}` (`offset` in the memory file;
//! releases before 1.11 send `page_size_kib`, which later ones keep, holding bytes despite
//! its name; the oldest send neither, meaning 4 KiB pages). It keeps its end of the socket
//! open for as long as it runs, so the socket closing is how a server learns the VM has
//! gone. With a balloon device it asks for remove events: each `MADV_DONTNEED` of guest
//! memory arrives as `UFFD_EVENT_REMOVE`, and the pages removed must read as zero when next
//! touched.
//!
//! [`Handshake::receive`] reads and checks that message: exactly one descriptor, which must
//! be a userfaultfd; JSON that parses; 1 to [`MAX_REGIONS`] regions, each page-aligned,
//! non-empty and of a page size Firecracker uses (4 KiB or 2 MiB); no two regions overlapping
//! in the peer's address space or in the memory file. [`PageServer::start`] then refuses a
//! memory file shorter than the regions before serving anything, and serves with the lazy
//! restore's engine: several handler threads, a block (1 MiB by default) per fault, each
//! block read once, a prefetch of a recorded working set first and then the rest. The peer
//! keeps its registration; this side registers nothing and so leaves nothing registered,
//! whether it stops cleanly or with an error.
//!
//! A failure while serving (the memory file unreadable) ends the server with an error that
//! names the region, the peer's address and the file offset. Firecracker's vCPU would then
//! wait on its fault for ever; [`PageServer::peer_pid`] names the process to stop (what
//! `guestmem serve-uffd` does unless told not to).

mod handshake;

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use handshake::{parse_regions, Handshake, UffdRegion, MAX_HANDSHAKE_BYTES, PAGE_SIZES};

use super::lazy::LazyRestore;
use super::LazyReport;
use crate::snapshot::{Image, SnapshotError};

/// Default block served per fault.
pub const DEFAULT_BLOCK_BYTES: u64 = 1 << 20;
/// Why a handshake or a page server failed; each names the region, address, file or limit
/// at fault.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A socket call failed.
    #[error("{op}: {source}")]
    Socket {
        /// What was done.
        op: String,
        /// The errno.
        source: io::Error,
    },
    /// The peer's handshake is not what Firecracker sends.
    #[error("handshake: {0}")]
    Handshake(String),
    /// The memory file cannot serve the regions.
    #[error("memory file {}: {reason}", path.display())]
    MemoryFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A working-set file does not parse or names offsets outside the regions.
    #[error("working set {}: {reason}", path.display())]
    WorkingSet {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Serving failed: the first error, naming the region, address and file offset.
    #[error("serving the peer's memory: {0}")]
    Serve(#[source] SnapshotError),
}

/// How to serve.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Threads reading faults.
    pub handler_threads: usize,
    /// Threads prefetching (0: no prefetch; faults alone bring memory in).
    pub prefetch_threads: usize,
    /// Memory-file offsets to prefetch first, in order (a recorded working set).
    pub first: Vec<u64>,
    /// Bytes served per fault (raised to the largest page size; a multiple of it).
    pub block_bytes: u64,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            handler_threads: crate::populate::default_threads(),
            prefetch_threads: crate::populate::default_threads(),
            first: Vec::new(),
            block_bytes: DEFAULT_BLOCK_BYTES,
        }
    }
}

/// How a page server ended.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ServeReport {
    /// What the engine did.
    pub engine: LazyReport,
    /// Why it stopped: `peer closed the socket`, `peer exited`, `stopped`.
    pub ended: String,
    /// From the start of serving until it ended, seconds.
    pub served_secs: f64,
    /// The memory-file offsets of the blocks the peer faulted, first fault first (see
    /// [`PageServer::working_set`]).
    #[serde(skip)]
    pub working_set: Vec<u64>,
}

/// A page server at work for one peer.
#[derive(Debug)]
pub struct PageServer {
    lazy: LazyRestore,
    image: Image,
    peer: UnixStream,
    peer_pid: Option<i32>,
    regions: Vec<UffdRegion>,
    t0: Instant,
}

impl PageServer {
    /// Checks `mem_file` against the handshake's regions (refusing one that does not hold
    /// them all, before anything is served) and starts serving.
    pub fn start(
        h: Handshake,
        mem_file: &Path,
        cfg: &ServeConfig,
    ) -> Result<PageServer, ServeError> {
        let ferr = |reason: String| ServeError::MemoryFile {
            path: mem_file.to_path_buf(),
            reason,
        };
        let len = std::fs::metadata(mem_file)
            .map_err(|e| ferr(format!("cannot stat it: {e}")))?
            .len();
        for (i, r) in h.regions.iter().enumerate() {
            if r.offset + r.size > len {
                return Err(ferr(format!(
                    "holds {len:#x} bytes, but region {i} (host {:#x}, {:#x} bytes) needs \
                     offsets {:#x}..{:#x}",
                    r.base_host_virt_addr,
                    r.size,
                    r.offset,
                    r.offset + r.size
                )));
            }
        }
        let largest = h.regions.iter().map(|r| r.page_size).max().unwrap_or(4096);
        let block = cfg.block_bytes.max(largest).next_multiple_of(largest);
        let spans: Vec<(u64, u64, u64, u64)> = h
            .regions
            .iter()
            .map(|r| (r.base_host_virt_addr, r.size, r.offset, r.page_size))
            .collect();
        let image = Image::raw(mem_file, &spans, block).map_err(|e| ferr(e.to_string()))?;
        let first = match cfg.prefetch_threads {
            0 => None,
            _ => Some(blocks_of(&image, &cfg.first)),
        };
        let places: Vec<(u64, u64, u64)> = h
            .regions
            .iter()
            .map(|r| (r.base_host_virt_addr, r.size, r.page_size))
            .collect();
        let lazy = LazyRestore::start_remote(
            &image,
            &places,
            h.uffd,
            (cfg.handler_threads, cfg.prefetch_threads),
            first,
        )
        .map_err(|source| ServeError::Socket {
            op: "start the handler threads".into(),
            source,
        })?;
        Ok(PageServer {
            lazy,
            image,
            peer: h.peer,
            peer_pid: h.peer_pid,
            regions: h.regions,
            t0: Instant::now(),
        })
    }

    /// The peer's process id (`SO_PEERCRED`).
    pub fn peer_pid(&self) -> Option<i32> {
        self.peer_pid
    }

    /// The regions served.
    pub fn regions(&self) -> &[UffdRegion] {
        &self.regions
    }

    /// Blocks in, and blocks in all.
    pub fn progress(&self) -> (u64, u64) {
        self.lazy.progress()
    }

    /// What it did so far.
    pub fn report(&self) -> LazyReport {
        self.lazy.report()
    }

    /// The memory-file offsets of the blocks the peer faulted, first fault first: a working
    /// set for the next server's [`ServeConfig::first`].
    pub fn working_set(&self) -> Vec<u64> {
        let bb = self.image.block_bytes();
        self.lazy
            .working_set()
            .into_iter()
            .map(|b| {
                let (ri, off, _) = self.image.block_span(b);
                self.image.regions()[ri].file_offset + off / bb * bb
            })
            .collect()
    }

    /// Serves until the peer goes away (it closes the socket or exits: `Ok`) or serving
    /// fails (the first error). Either way the handler and prefetch threads are stopped and
    /// the descriptor closed when this returns.
    pub fn wait(mut self) -> Result<ServeReport, ServeError> {
        let ended = loop {
            if self.lazy.failure().is_some() {
                break None;
            }
            if self.lazy.peer_gone() {
                break Some("peer exited");
            }
            if peer_hung_up(&self.peer) {
                break Some("peer closed the socket");
            }
            self.lazy.wait_for(Duration::from_millis(20));
        };
        let engine = self.lazy.halt();
        match ended {
            Some(why) => Ok(ServeReport {
                engine,
                ended: why.into(),
                served_secs: self.t0.elapsed().as_secs_f64(),
                working_set: self.working_set(),
            }),
            None => Err(ServeError::Serve(self.lazy.take_error().unwrap_or_else(
                || SnapshotError::Stopped(self.lazy.failure().unwrap_or_default()),
            ))),
        }
    }
}

/// Blocks of `image` holding `offsets` (memory-file offsets), first occurrence first;
/// offsets outside every region are left out.
fn blocks_of(image: &Image, offsets: &[u64]) -> Vec<u64> {
    let bb = image.block_bytes();
    offsets
        .iter()
        .filter_map(|&o| {
            image
                .regions()
                .iter()
                .find(|r| o >= r.file_offset && o < r.file_offset + r.size)
                .map(|r| r.first_block + (o - r.file_offset) / bb)
        })
        .collect()
}

/// A recorded working set, as `guestmem serve-uffd --record` writes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkingSetFile {
    /// Always `guestmem-working-set`.
    pub format: String,
    /// Memory-file offsets of the blocks faulted, first fault first.
    pub offsets: Vec<u64>,
}

impl WorkingSetFile {
    /// The format's name.
    pub const FORMAT: &'static str = "guestmem-working-set";

    /// Reads and checks `path`.
    pub fn read(path: &Path) -> Result<Vec<u64>, ServeError> {
        let werr = |reason: String| ServeError::WorkingSet {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read(path).map_err(|e| werr(e.to_string()))?;
        let w: WorkingSetFile = serde_json::from_slice(&text).map_err(|e| werr(e.to_string()))?;
        if w.format != Self::FORMAT {
            return Err(werr(format!(
                "format {:?}, expected {:?}",
                w.format,
                Self::FORMAT
            )));
        }
        Ok(w.offsets)
    }

    /// Writes `offsets` to `path` (through a rename, so a reader never sees half of it).
    pub fn write(path: &Path, offsets: &[u64]) -> io::Result<()> {
        let w = WorkingSetFile {
            format: Self::FORMAT.into(),
            offsets: offsets.to_vec(),
        };
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(&w).expect("serialises"))?;
        std::fs::rename(&tmp, path)
    }
}

/// Whether the peer closed its end (or reset it). Bytes it sends after the handshake are
/// read and dropped (Firecracker sends none).
fn peer_hung_up(s: &UnixStream) -> bool {
    let mut pfd = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one live pollfd; no waiting.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    if n <= 0 {
        return false;
    }
    if pfd.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0 {
        return true;
    }
    let mut buf = [0u8; 4096];
    // SAFETY: reads at most buf.len() bytes into buf; MSG_DONTWAIT never blocks.
    let k = unsafe {
        libc::recv(
            s.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    k == 0
}
