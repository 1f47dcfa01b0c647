//! One VM being served: its regions checked against its socket's memory file, the lazy
//! engine started over its memory (faults read by the server's pool), how the server
//! learns it went, and how serving it ends.
//!
//! A session is started from a fresh handshake ([`Session::start`]) or from a VM taken over
//! from a server that died or handed it on ([`Session::resume`]: pages already in are left,
//! waiting threads woken). It ends one way ([`Session::conclude`]): the engine halted (its
//! huge-page collapse stopped after the chunk it is on), and a report of what it did.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Instant;

use super::error::MemoryFileProblem;
use super::files::{MemoryFile, Source};
use super::handshake::Handshake;
use super::peer::PeerProcess;
use super::regions::{UffdRegion, SMALL_PAGE_BYTES};
use super::report::{SessionEnd, SessionReport};
use super::ServeError;
use crate::restore::{PeerRange, Pooled, Regaining, RemoteRestore, Start};
use crate::snapshot::{Image, RawRegion, SnapshotError};
use crate::sys::PollFd;
use crate::uffd::Uffd;

/// How a server learns its VM went: Firecracker keeps its socket open while it runs, so the
/// socket closing says so; a VM taken over after a restart has no socket to this server,
/// and its pidfd turning readable says so instead, as it does for a VM that closed its
/// socket but runs on holding its userfaultfd ([`Session::follow_pidfd`]).
#[derive(Debug)]
enum Link {
    Socket(UnixStream),
    Pidfd,
}

/// Why serving a VM is over, as its supervisor found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Over {
    /// It closed its socket.
    PeerClosed,
    /// Its process (or address space) is gone.
    PeerExited,
    /// Serving it failed.
    Failed,
}

/// What a session is started with, beside its VM.
pub(super) struct Plan<'a> {
    /// The snapshot served.
    pub(super) memory: &'a MemoryFile,
    /// Its socket's index.
    pub(super) socket: usize,
    /// Memory-file offsets to prefetch first, when the VM is prefetched at all (`None`:
    /// faults alone bring its memory in).
    pub(super) prefetch: Option<&'a [u64]>,
    /// Bytes per block (raised to the largest page size).
    pub(super) block_bytes: u64,
    /// Collapse its 4 KiB memory to huge pages once all of it is in.
    pub(super) regain_huge: bool,
}

/// One VM being served.
#[derive(Debug)]
pub(super) struct Session {
    pub(super) socket: usize,
    pub(super) bytes: u64,
    pub(super) t0: Instant,
    /// Its record in the state directory.
    pub(super) record: Option<PathBuf>,
    engine: RemoteRestore,
    image: Image,
    link: Link,
    process: PeerProcess,
    regions: Vec<UffdRegion>,
    /// It closed its socket and runs on ([`Session::follow_pidfd`]).
    hung_up: bool,
    /// Taken back from a server that died or handed it over.
    resumed: bool,
    /// The pages its balloon removed, as a server that handed it over sent them.
    pub(super) handed_removed: Option<std::os::fd::OwnedFd>,
}

/// A VM that could not be served, and the process to end.
pub(super) type Refusal = (ServeError, PeerProcess);

impl Session {
    /// Serves the VM of a fresh handshake.
    pub(super) fn start(h: Handshake, plan: &Plan<'_>) -> Result<Session, Refusal> {
        let Handshake {
            regions,
            uffd,
            peer,
            process,
        } = h;
        Session::launch(
            regions,
            uffd,
            process,
            Link::Socket(peer),
            plan,
            Start::Fresh,
        )
    }

    /// Serves again a VM whose server died or handed it over: `uffd` taken back from it (or
    /// handed), its `regions` as that server recorded them.
    pub(super) fn resume(
        regions: Vec<UffdRegion>,
        uffd: Uffd,
        process: PeerProcess,
        plan: &Plan<'_>,
    ) -> Result<Session, Refusal> {
        Session::launch(regions, uffd, process, Link::Pidfd, plan, Start::Resumed)
    }

    fn launch(
        regions: Vec<UffdRegion>,
        uffd: Uffd,
        process: PeerProcess,
        link: Link,
        plan: &Plan<'_>,
        start: Start,
    ) -> Result<Session, Refusal> {
        let image = match image_of(&regions, plan.memory, plan.block_bytes) {
            Ok(i) => i,
            Err(e) => return Err((e, process)),
        };
        let ranges: Vec<PeerRange> = regions
            .iter()
            .map(|r| PeerRange {
                host: r.base_host_virt_addr,
                size: r.size,
                page: r.page_size,
            })
            .collect();
        let working_set = plan.prefetch.map(|offsets| blocks_of(&image, offsets));
        let mut engine = match RemoteRestore::start(&image, &ranges, uffd, working_set, start) {
            Ok(e) => e,
            Err(source) => {
                return Err((
                    ServeError::Io {
                        op: "start serving the VM",
                        source,
                    },
                    process,
                ))
            }
        };
        if plan.regain_huge {
            regain(&mut engine, &regions, &process);
        }
        Ok(Session {
            socket: plan.socket,
            bytes: regions.iter().map(|r| r.size).sum(),
            t0: Instant::now(),
            record: None,
            engine,
            image,
            link,
            process,
            regions,
            hung_up: false,
            resumed: start == Start::Resumed,
            handed_removed: None,
        })
    }

    /// Whether it was taken back from a server that died or handed it over.
    pub(super) fn resumed(&self) -> bool {
        self.resumed
    }

    /// Marks removed the pages its balloon removed under a previous server (`file`: that
    /// server's removed-pages file, or the memfd it handed over); returns how many.
    pub(super) fn load_removes(&self, file: &std::fs::File) -> std::io::Result<u64> {
        self.engine.load_removes(file)
    }

    /// Keeps the pages its balloon removes in `file` from now on, for a later server.
    pub(super) fn log_removes_to(&self, file: std::fs::File) -> std::io::Result<()> {
        self.engine.log_removes_to(file)
    }

    /// Reads nothing more from its userfaultfd until [`Session::resume_reading`] (it is
    /// being handed over).
    pub(super) fn stop_reading(&self) {
        self.engine.stop_reading();
    }

    /// Reads again (a hand-off not taken).
    pub(super) fn resume_reading(&self) {
        self.engine.resume_reading();
    }

    /// Its removed pages in a memfd, for a server it is handed to (`None`: it removed none).
    pub(super) fn removed_memfd(&self) -> std::io::Result<Option<std::os::fd::OwnedFd>> {
        self.engine.removed_memfd()
    }

    /// The VM's process.
    pub(super) fn process(&self) -> &PeerProcess {
        &self.process
    }

    /// The regions served.
    pub(super) fn regions(&self) -> &[UffdRegion] {
        &self.regions
    }

    /// Its userfaultfd.
    pub(super) fn uffd_fd(&self) -> BorrowedFd<'_> {
        self.engine.uffd_fd()
    }

    /// The fault side, for the pool.
    pub(super) fn pooled(&self) -> Pooled {
        self.engine.pooled()
    }

    /// What the server polls for this VM: its link (socket or pidfd) and the engine's
    /// failure descriptor.
    pub(super) fn watch(&self) -> [PollFd<'_>; 2] {
        let link = match (&self.link, self.process.pidfd()) {
            (Link::Socket(s), _) => PollFd::with(s.as_fd(), libc::POLLIN | libc::POLLRDHUP),
            (Link::Pidfd, Some(p)) => PollFd::readable(p),
            // No pidfd: the engine finds the VM gone at its next fill (`ESRCH`).
            (Link::Pidfd, None) => PollFd::skip(),
        };
        [link, PollFd::readable(self.engine.changed_fd())]
    }

    /// Whether serving is over, and why, without waiting.
    pub(super) fn over(&self) -> Option<Over> {
        if self.engine.has_failed() {
            return Some(Over::Failed);
        }
        if self.engine.peer_gone() {
            // A VM that hung up and let go of its memory, unless it has exited since.
            let exited = self.process.pidfd().is_none_or(crate::sys::is_readable);
            return Some(if self.hung_up && !exited {
                Over::PeerClosed
            } else {
                Over::PeerExited
            });
        }
        match &self.link {
            Link::Socket(s) => socket_closed(s).then_some(Over::PeerClosed),
            Link::Pidfd => self
                .process
                .pidfd()
                .is_none_or(crate::sys::is_readable)
                .then_some(Over::PeerExited),
        }
    }

    /// Whether its VM, its socket closed, runs on holding the userfaultfd served
    /// ([`PeerProcess::runs_on_holding`]): it must be served on, or its next fault would
    /// wait forever.
    pub(super) fn runs_on(&self) -> bool {
        matches!(self.link, Link::Socket(_)) && self.process.runs_on_holding(self.uffd_fd())
    }

    /// Watches its VM through its pidfd from now on, its socket closed (and dropped); its
    /// memory found unmapped from now on ends the session as the VM's hang-up, not as a
    /// failure.
    pub(super) fn follow_pidfd(&mut self) {
        self.link = Link::Pidfd;
        self.hung_up = true;
        self.engine.let_go_on_unmap();
    }

    /// Whether its VM hung up, ran on, and then let go of its memory (a fill found it
    /// unmapped).
    pub(super) fn let_go(&self) -> bool {
        self.hung_up && self.engine.peer_gone()
    }

    /// Brings every block in, then unregisters the VM's ranges (see
    /// `RemoteRestore::graduate`).
    pub(super) fn graduate(&mut self) -> Result<(), SnapshotError> {
        self.engine.graduate().map(|_| ())
    }

    /// Stops serving: the engine halted, its collapse stopped (after the chunk it is on).
    /// The report, the VM (to end, when it failed), and the collapse still running, if one
    /// is. A failed session's error is taken first ([`Session::failure`]).
    pub(super) fn conclude(mut self, id: u64, end: SessionEnd) -> Concluded {
        let engine = self.engine.halt();
        let working_set = self.working_set();
        let collapse = self.engine.regaining().filter(|r| r.report().is_none());
        Concluded {
            report: SessionReport {
                id,
                socket: self.socket,
                pid: self.process.pid(),
                bytes: self.bytes,
                end,
                engine,
                served_secs: self.t0.elapsed().as_secs_f64(),
                working_set,
            },
            process: self.process,
            collapse,
        }
    }

    /// Stops serving a VM that was never admitted; its process, to end.
    pub(super) fn abandon(mut self) -> PeerProcess {
        self.engine.halt();
        self.process
    }

    /// The error serving failed with (taken), once it has.
    pub(super) fn failure(&self) -> ServeError {
        ServeError::Serve(Box::new(
            self.engine
                .take_error()
                .unwrap_or(SnapshotError::AlreadyReported),
        ))
    }

    /// The memory-file offsets of the blocks the VM faulted, first fault first: a working
    /// set for its snapshot's later VMs.
    pub(super) fn working_set(&self) -> Vec<u64> {
        let bb = self.image.block_bytes();
        self.engine
            .working_set()
            .into_iter()
            .map(|b| {
                let (ri, off, _) = self.image.block_span(b);
                self.image.regions()[ri].file_offset + off / bb * bb
            })
            .collect()
    }
}

/// A session as it ended.
pub(super) struct Concluded {
    pub(super) report: SessionReport,
    pub(super) process: PeerProcess,
    /// Its huge-page collapse, stopped but not yet ended.
    pub(super) collapse: Option<Regaining>,
}

/// Whether the peer closed its end of `s` (a hang-up, or end of file). Bytes it sent
/// (Firecracker sends none) are read and dropped.
fn socket_closed(s: &UnixStream) -> bool {
    let mut fds = [PollFd::with(s.as_fd(), libc::POLLIN | libc::POLLRDHUP)];
    if !crate::sys::poll(&mut fds, Some(std::time::Duration::ZERO)).is_ok_and(|n| n > 0) {
        return false;
    }
    if fds[0].revents() & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0 {
        return true;
    }
    let mut buf = [0u8; 4096];
    // The socket is blocking, but poll said it is readable: this read does not wait.
    matches!(std::io::Read::read(&mut &*s, &mut buf), Ok(0))
}

/// Queues the collapse of the VM's 4 KiB regions to huge pages (hugetlb ones are huge
/// already), through a duplicate of its pidfd; none without a pidfd or a pid.
fn regain(engine: &mut RemoteRestore, regions: &[UffdRegion], process: &PeerProcess) {
    let ranges: Vec<(u64, u64)> = regions
        .iter()
        .filter(|r| r.page_size == SMALL_PAGE_BYTES)
        .map(|r| (r.base_host_virt_addr, r.size))
        .collect();
    let Some(pid) = process.pid().and_then(|p| u32::try_from(p).ok()) else {
        return;
    };
    let Some(pidfd) = process.pidfd().and_then(|p| p.try_clone_to_owned().ok()) else {
        return;
    };
    if !ranges.is_empty() {
        engine.regain_when_complete(pidfd, pid, ranges);
    }
}

/// The memory file as an image of the VM's regions, once checked to hold them all; blocks
/// of `block_bytes`, raised to (and a multiple of) the largest page size.
fn image_of(
    regions: &[UffdRegion],
    mem: &MemoryFile,
    block_bytes: u64,
) -> Result<Image, ServeError> {
    let len = mem.len;
    for (i, r) in regions.iter().enumerate() {
        // parse_regions checked offset + size does not overflow.
        if r.offset + r.size > len {
            return Err(mem.error(MemoryFileProblem::TooShort {
                len,
                region: i,
                host: r.base_host_virt_addr,
                size: r.size,
                offset: r.offset,
            }));
        }
    }
    let largest = regions
        .iter()
        .map(|r| r.page_size)
        .max()
        .unwrap_or(SMALL_PAGE_BYTES);
    // A snapshot in the store is served a frame a fault: a larger block would fetch frames
    // the VM did not ask for, one GET each.
    let block_bytes = match &mem.source {
        Source::File(_) => block_bytes,
        #[cfg(feature = "store")]
        Source::Store(m) => m.snapshot().frame_bytes(),
    };
    let block = block_bytes.max(largest).next_multiple_of(largest);
    let raw: Vec<RawRegion> = regions
        .iter()
        .map(|r| RawRegion {
            name: r.base_host_virt_addr,
            size: r.size,
            file_offset: r.offset,
            page_size: r.page_size,
        })
        .collect();
    let image = match &mem.source {
        Source::File(f) => {
            let file = f.try_clone().map_err(|source| {
                mem.error(MemoryFileProblem::Open {
                    op: "duplicate the descriptor of",
                    source,
                })
            })?;
            Image::raw(file, &mem.path, &raw, block)
        }
        #[cfg(feature = "store")]
        Source::Store(m) => m.raw_image(&raw, block),
    };
    image.map_err(|e| mem.error(MemoryFileProblem::Image(Box::new(e))))
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
