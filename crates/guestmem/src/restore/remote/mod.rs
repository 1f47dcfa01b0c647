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
//! be a userfaultfd; JSON that parses; 1 to [`crate::MAX_REGIONS`] regions, each page-aligned,
//! non-empty and of a page size Firecracker uses (4 KiB or 2 MiB); no two regions overlapping
//! in the peer's address space or in the memory file. [`PageServer::start`] then refuses a
//! memory file shorter than the regions before serving anything, and serves with the lazy
//! restore's engine: several handler threads, a block (1 MiB by default) per fault, each
//! block read once, a prefetch of a recorded working set first and then the rest. The peer
//! keeps its registration; this side registers nothing and so leaves nothing registered,
//! whether it stops cleanly or with an error.
//!
//! [`Listener::bind`] publishes the socket whole: bound and listening under a temporary name,
//! then renamed into place, so a VMM that connects as soon as the path appears is never
//! refused; a live server's socket is never replaced, and on exit the path is removed only
//! if it still names this server's socket. [`serve_one`] takes connections until one is a
//! VM: a connection that sends no userfaultfd, or nothing within the handshake timeout, is
//! dropped and logged while the server listens on (handshakes run side by side, so a squatter
//! does not hold up the real VM).
//!
//! Once a VM has sent its userfaultfd it depends on this server: Firecracker keeps its own
//! reference, so a VM whose server stops serving waits on its faults for ever. Every refusal
//! from then on (a handshake that does not hold together, a memory file shorter than the
//! regions, a userfaultfd asking for fork, remap or unmap events) and every serving failure
//! (the file unreadable) ends the VM as [`OnFailure`] says, through a pidfd taken when it
//! connected (`SO_PEERPIDFD`, so a reused pid is never signalled; see [`PeerProcess`] for
//! older kernels), and logs why. Idle means
//! blocked: handlers wait in `poll` without a timeout, and the server waits on the peer's
//! socket and the engine's failure descriptor.
//!
//! [`serve_one`] serves one VM. [`Fleet`] serves every VM that connects to any of its
//! sockets (a snapshot each) on one shared pool of threads, within limits, until drained,
//! and with a state directory outlives its own crash: see the `fleet` module's docs.

mod config;
mod error;
mod files;
mod fleet;
mod handshake;
mod listen;
pub(crate) mod peer;
mod pool;
mod regions;
mod state;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

pub(crate) use config::SessionEvent;
pub use config::{OnFailure, ServeConfig, ServeLog, Setting};
pub use error::ServeError;
pub use files::{MemoryFile, WorkingSetFile};
pub use fleet::{
    take_over, Drainer, Exposed, Fleet, FleetConfig, FleetReport, FleetSocket, FleetStatus,
    SessionEnd, SessionReport, SessionStatus, SocketStatus, StatusHandle, TakeOver,
    DEFAULT_MAX_SESSIONS,
};
pub use handshake::{Handshake, HandshakeError, MAX_HANDSHAKE_BYTES};
pub use listen::{Listener, SocketRefusal};
pub use peer::PeerProcess;
pub use regions::{parse_regions, UffdRegion, PAGE_SIZES};

use super::lazy::{Handlers, LazyRestore, Target};
use super::LazyReport;
use crate::snapshot::{Image, SnapshotError};

/// Default block served per fault.
pub const DEFAULT_BLOCK_BYTES: u64 = 1 << 20;
/// Largest block served per fault: each handler and prefetch thread stages one block, so
/// this bounds what a `block_bytes` can make the server allocate (Firecracker's largest page
/// is 2 MiB).
pub const MAX_BLOCK_BYTES: u64 = 64 << 20;
/// Most handler or prefetch threads one server starts.
pub const MAX_SERVE_THREADS: usize = 1024;
/// Default time a connected peer has to send its whole handshake.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest working-set file read.
pub const MAX_WORKING_SET_BYTES: u64 = 64 << 20;

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
    /// The VM's connection; `None` for a VM taken over from a server that died (its
    /// connection died with it): then its pidfd says when it exits.
    peer: Option<UnixStream>,
    process: PeerProcess,
    regions: Vec<UffdRegion>,
    t0: Instant,
}

/// Waits for one VM on `listener`, stops listening (the socket is closed and its path
/// removed, so a second VM that tries it is refused at `connect` rather than left waiting),
/// serves the VM until it goes, and returns what was done.
/// Connections that hand over no userfaultfd, or say nothing within
/// [`ServeConfig::handshake_timeout`], are dropped with a log line while the server listens
/// on. From the moment a VM has sent its userfaultfd, every refusal or serving failure ends
/// it as [`ServeConfig::on_failure`] says (through the pidfd taken when it connected) and
/// logs why; the error is returned.
pub fn serve_one(
    listener: Listener,
    mem: &MemoryFile,
    cfg: &ServeConfig,
) -> Result<ServeReport, ServeError> {
    cfg.check()?;
    let h = listener.next_vm(cfg)?;
    drop(listener);
    cfg.log.say(&format!(
        "peer {} sent {} regions ({} MiB)",
        h.process.pid().map_or("?".into(), |p| p.to_string()),
        h.regions.len(),
        h.regions.iter().map(|r| r.size).sum::<u64>() >> 20
    ));
    let how = (Handlers::Own(cfg.handler_threads), Target::Fresh);
    let server = match PageServer::launch(h, mem, cfg, how) {
        Ok(s) => s,
        Err((e, process)) => {
            end_peer(&process, cfg, &e);
            return Err(e);
        }
    };
    let (result, process) = server.wait_inner();
    if let Err(e) = &result {
        end_peer(&process, cfg, e);
    }
    result
}

/// Applies `cfg.on_failure` to a VM that cannot be served, and logs what was done and why.
pub(crate) fn end_peer(process: &PeerProcess, cfg: &ServeConfig, why: &dyn std::fmt::Display) {
    let who = process.pid().map_or("?".into(), |p| p.to_string());
    match cfg.on_failure {
        OnFailure::Kill => match process.kill() {
            Ok(()) => cfg.log.warn(&format!(
                "killed the peer {who} (through its pidfd): its memory cannot be served: {why}"
            )),
            Err(e) => cfg.log.warn(&format!(
                "could not kill the peer {who} ({e}); it may wait for ever: {why}"
            )),
        },
        OnFailure::Leave => cfg.log.warn(&format!(
            "left the peer {who} as --on-failure leave says; it waits on memory that will not \
             come: {why}"
        )),
    }
}

impl PageServer {
    /// Checks `mem` against the handshake's regions (refusing one that does not hold them
    /// all, before anything is served) and starts serving. On failure the peer is not ended:
    /// [`serve_one`] does that as its policy says.
    pub fn start(
        h: Handshake,
        mem: &MemoryFile,
        cfg: &ServeConfig,
    ) -> Result<PageServer, ServeError> {
        let how = (Handlers::Own(cfg.handler_threads), Target::Fresh);
        PageServer::launch(h, mem, cfg, how).map_err(|(e, _)| e)
    }

    pub(crate) fn launch(
        h: Handshake,
        mem: &MemoryFile,
        cfg: &ServeConfig,
        (handlers, target): (Handlers, Target),
    ) -> Result<PageServer, (ServeError, PeerProcess)> {
        let Handshake {
            regions,
            uffd,
            peer,
            process,
        } = h;
        PageServer::serve_parts(
            (regions, uffd, process),
            Some(peer),
            mem,
            cfg,
            (handlers, target),
        )
    }

    /// Takes over a VM whose server died: `uffd` taken back from it (`pidfd_getfd`), its
    /// `regions` as that server recorded them; pages already in are left, threads waiting
    /// are woken to fault again.
    pub(crate) fn resume(
        parts: (Vec<UffdRegion>, crate::uffd::Uffd, PeerProcess),
        mem: &MemoryFile,
        cfg: &ServeConfig,
    ) -> Result<PageServer, (ServeError, PeerProcess)> {
        PageServer::serve_parts(parts, None, mem, cfg, (Handlers::Pool, Target::Resumed))
    }

    fn serve_parts(
        (regions, uffd, process): (Vec<UffdRegion>, crate::uffd::Uffd, PeerProcess),
        peer: Option<UnixStream>,
        mem: &MemoryFile,
        cfg: &ServeConfig,
        (handlers, target): (Handlers, Target),
    ) -> Result<PageServer, (ServeError, PeerProcess)> {
        let started = cfg
            .check()
            .and_then(|()| image_of(&regions, mem, cfg))
            .and_then(|image| {
                let first = match cfg.prefetch_threads {
                    0 => None,
                    _ => Some(blocks_of(&image, &cfg.first)),
                };
                let places: Vec<(u64, u64, u64)> = regions
                    .iter()
                    .map(|r| (r.base_host_virt_addr, r.size, r.page_size))
                    .collect();
                let threads = (handlers, cfg.prefetch_threads);
                LazyRestore::start_remote(&image, &places, uffd, threads, first, target)
                    .map(|lazy| (lazy, image))
                    .map_err(|source| ServeError::Socket {
                        op: "start the handler threads".into(),
                        source,
                    })
            });
        match started {
            Ok((mut lazy, image)) => {
                if cfg.regain_huge {
                    if let Some((job, handle)) = regain_job(&regions, &process, &image) {
                        lazy.regain_when_complete(job, handle);
                    }
                }
                Ok(PageServer {
                    lazy,
                    image,
                    peer,
                    process,
                    regions,
                    t0: Instant::now(),
                })
            }
            Err(e) => Err((e, process)),
        }
    }

    /// The peer's process id (`SO_PEERCRED`).
    pub fn peer_pid(&self) -> Option<i32> {
        self.process.pid()
    }

    /// The regions served.
    pub fn regions(&self) -> &[UffdRegion] {
        &self.regions
    }

    /// Blocks in, of all.
    pub fn progress(&self) -> crate::Progress {
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
    /// the descriptor closed when this returns. Blocks in `poll` on the peer's socket and
    /// the engine's failure descriptor: an idle server uses no CPU.
    pub fn wait(self) -> Result<ServeReport, ServeError> {
        self.wait_inner().0
    }

    fn wait_inner(self) -> (Result<ServeReport, ServeError>, PeerProcess) {
        let ended = loop {
            if let Some(e) = self.ended(-1) {
                break e;
            }
        };
        self.conclude(ended)
    }

    /// Whether serving is over, waiting up to `ms` (-1: for ever) on the peer's socket and
    /// the engine's failure descriptor: `Some(None)` failed, `Some(Some(why))` the peer went.
    pub(crate) fn ended(&self, ms: i32) -> Option<Option<&'static str>> {
        if self.lazy.failure().is_some() {
            return Some(None);
        }
        if self.lazy.peer_gone() {
            return Some(Some("peer exited"));
        }
        let link = match (&self.peer, self.process.pidfd()) {
            (Some(s), _) => Link::Socket(s),
            (None, Some(p)) => Link::Pidfd(p),
            (None, None) => return Some(Some("peer exited")),
        };
        let gone = if self.peer.is_some() {
            "peer closed the socket"
        } else {
            "peer exited"
        };
        match wait_peer(link, self.lazy.changed_fd(), ms) {
            PeerState::HungUp => Some(Some(gone)),
            PeerState::Quiet => None,
        }
    }

    /// The peer's socket and the engine's failure descriptor: what a supervisor polls.
    pub(crate) fn watch_fds(&self) -> [std::os::fd::BorrowedFd<'_>; 2] {
        use std::os::fd::AsFd;
        let peer = match (&self.peer, self.process.pidfd()) {
            (Some(s), _) => s.as_fd(),
            (None, Some(p)) => p,
            (None, None) => self.lazy.changed_fd(),
        };
        [peer, self.lazy.changed_fd()]
    }

    /// The VM's process.
    pub(crate) fn process(&self) -> &PeerProcess {
        &self.process
    }

    /// Its userfaultfd.
    pub(crate) fn uffd_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.lazy.uffd_fd()
    }

    /// The fault side, for a shared pool.
    pub(crate) fn pooled(&self) -> super::lazy::Pooled {
        self.lazy.pooled()
    }

    /// Brings every block in, then unregisters the peer's ranges (see
    /// `LazyRestore::graduate`).
    pub(crate) fn graduate(&mut self) -> Result<LazyReport, SnapshotError> {
        self.lazy.graduate()
    }

    /// Stops serving and says how it ended: `why` the peer went, or `None` (it failed).
    pub(crate) fn conclude(
        mut self,
        ended: Option<&'static str>,
    ) -> (Result<ServeReport, ServeError>, PeerProcess) {
        let engine = self.lazy.halt();
        let result = match ended {
            Some(why) => Ok(ServeReport {
                engine,
                ended: why.into(),
                served_secs: self.t0.elapsed().as_secs_f64(),
                working_set: self.working_set(),
            }),
            None => Err(ServeError::Serve(
                self.lazy
                    .take_error()
                    .unwrap_or(SnapshotError::AlreadyReported),
            )),
        };
        (result, self.process)
    }
}

/// The collapse of the peer's 4 KiB regions to huge pages (hugetlb ones are huge already),
/// through a duplicate of its pidfd; none without a pidfd or a pid.
fn regain_job(
    regions: &[UffdRegion],
    process: &PeerProcess,
    image: &Image,
) -> Option<(super::regain::Job, super::Regaining)> {
    let ranges: Vec<(u64, u64)> = regions
        .iter()
        .filter(|r| r.page_size == 4096)
        .map(|r| (r.base_host_virt_addr, r.size))
        .collect();
    let pid = u32::try_from(process.pid()?).ok()?;
    let pidfd = process.pidfd()?.try_clone_to_owned().ok()?;
    if ranges.is_empty() {
        return None;
    }
    let memory = super::regain::Memory::Remote { pidfd, pid, ranges };
    let hosts: Vec<u64> = regions.iter().map(|r| r.base_host_virt_addr).collect();
    Some(super::regain::Job::new(
        memory,
        None,
        image.data_spans(&hosts),
    ))
}

/// The memory file as an image of the peer's regions, once checked to hold them all;
/// blocks of `cfg.block_bytes`, raised to (and a multiple of) the largest page size.
fn image_of(
    regions: &[UffdRegion],
    mem: &MemoryFile,
    cfg: &ServeConfig,
) -> Result<Image, ServeError> {
    let ferr = |reason: String| ServeError::MemoryFile {
        path: mem.path.clone(),
        reason,
    };
    let len = mem.len;
    for (i, r) in regions.iter().enumerate() {
        // parse_regions checked offset + size does not overflow.
        if r.offset + r.size > len {
            return Err(ferr(format!(
                "holds {len:#x} bytes, but region {i} (peer host address {:#x}, {:#x} bytes) \
                 needs offsets {:#x}..{:#x}",
                r.base_host_virt_addr,
                r.size,
                r.offset,
                r.offset + r.size
            )));
        }
    }
    let largest = regions.iter().map(|r| r.page_size).max().unwrap_or(4096);
    let block = cfg.block_bytes.max(largest).next_multiple_of(largest);
    let spans: Vec<(u64, u64, u64, u64)> = regions
        .iter()
        .map(|r| (r.base_host_virt_addr, r.size, r.offset, r.page_size))
        .collect();
    let file = mem
        .file
        .try_clone()
        .map_err(|e| ferr(format!("cannot duplicate its descriptor: {e}")))?;
    Image::raw(file, &mem.path, &spans, block).map_err(|e| ferr(e.to_string()))
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

/// What waiting on a peer found.
enum PeerState {
    /// It closed its end (or reset it).
    HungUp,
    /// Something changed elsewhere (the engine failed or lost the peer), or the peer sent
    /// bytes, which are read and dropped (Firecracker sends none).
    Quiet,
}

/// How a server learns its VM went: its socket closes, or (taken over after a restart) its
/// pidfd becomes readable.
enum Link<'a> {
    Socket(&'a UnixStream),
    Pidfd(std::os::fd::BorrowedFd<'a>),
}

/// Waits up to `ms` (-1: for ever) until the peer hangs up or sends something, or
/// `changed` becomes readable.
fn wait_peer(link: Link<'_>, changed: std::os::fd::BorrowedFd<'_>, ms: i32) -> PeerState {
    let s = match link {
        Link::Socket(s) => s,
        Link::Pidfd(p) => {
            let mut fds = [p.as_raw_fd(), changed.as_raw_fd()].map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            });
            // SAFETY: two live pollfds.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
            return if fds[0].revents != 0 {
                PeerState::HungUp
            } else {
                PeerState::Quiet
            };
        }
    };
    let mut fds = [
        libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        },
        libc::pollfd {
            fd: changed.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: two live pollfds; a server waits with no timeout (idle means blocked).
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
    if n <= 0 || fds[0].revents == 0 {
        return PeerState::Quiet;
    }
    if fds[0].revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0 {
        return PeerState::HungUp;
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
    if k == 0 {
        PeerState::HungUp
    } else {
        PeerState::Quiet
    }
}
