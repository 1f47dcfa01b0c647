//! What a server is doing, for an operator: the VMs served now with what their engines did,
//! and per snapshot (socket) totals over every VM served so far (how their sessions ended,
//! faults, bytes, fault latency by class). Read at any time from any thread
//! ([`StatusHandle`]); the counts come from the engines' own atomics, so reading costs the
//! server nothing. Totals are per socket, never per VM, so the status, a metrics scrape and
//! the server's memory stay bounded however many VMs come and go.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::report::SessionEnd;
use crate::restore::{FaultLatency, LazyReport, Pooled};

/// A server's state now.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ServerStatus {
    /// Since the server started, seconds.
    pub uptime_secs: f64,
    /// Whether it is draining (no VM is accepted any more).
    pub draining: bool,
    /// Threads serving faults, shared by every VM.
    pub pool_threads: usize,
    /// Threads prefetching, shared by every VM.
    pub prefetch_threads: usize,
    /// Each socket (a snapshot), with totals over every VM it served.
    pub sockets: Vec<SocketStatus>,
    /// The VMs served now.
    pub sessions: Vec<SessionStatus>,
    /// VMs refused or ended because they could not be served.
    pub refused: u64,
    /// Connections dropped that were not a VM's.
    pub dropped: u64,
    /// Fetching from object storage and the frame cache (none when no socket serves a
    /// snapshot in the store).
    #[cfg(feature = "store")]
    pub store: Option<crate::store::StoreStatus>,
}

/// One socket's totals.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SocketStatus {
    /// Its index, in the order given.
    pub socket: usize,
    /// Where VMs connect.
    pub path: PathBuf,
    /// The memory file it serves.
    pub mem_file: PathBuf,
    /// VMs served now.
    pub serving: usize,
    /// VMs admitted since the start.
    pub sessions: u64,
    /// How the sessions that ended, ended.
    pub ended: EndCounts,
    /// Faults answered, all its VMs.
    pub faults: u64,
    /// Bytes installed, all its VMs.
    pub bytes_copied: u64,
    /// Fault latency by class, all its VMs together.
    pub fault_latency: FaultLatency,
}

/// Sessions ended, by how.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct EndCounts {
    /// The VM closed its socket.
    pub peer_closed: u64,
    /// The VM exited.
    pub peer_exited: u64,
    /// Graduated at a drain.
    pub graduated: u64,
    /// Handed to a new server.
    pub handed_off: u64,
    /// Failed (and the VM ended as the policy says).
    pub failed: u64,
}

impl EndCounts {
    fn count(&mut self, end: &SessionEnd) {
        match end {
            SessionEnd::PeerClosed => self.peer_closed += 1,
            SessionEnd::PeerExited => self.peer_exited += 1,
            SessionEnd::Graduated => self.graduated += 1,
            SessionEnd::HandedOff => self.handed_off += 1,
            SessionEnd::Failed(_) => self.failed += 1,
        }
    }

    /// Every session counted.
    pub fn total(&self) -> u64 {
        self.peer_closed + self.peer_exited + self.graduated + self.handed_off + self.failed
    }
}

/// One VM served now.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SessionStatus {
    /// Its session number.
    pub id: u64,
    /// The socket it came on.
    pub socket: usize,
    /// Its process.
    pub pid: Option<i32>,
    /// Guest memory, bytes.
    pub bytes: u64,
    /// Since it was admitted, seconds.
    pub age_secs: f64,
    /// What its engine did so far (first fault and all-resident times included).
    pub engine: LazyReport,
}

/// A VM being served, as the status sees it.
struct LiveSession {
    socket: usize,
    pid: Option<i32>,
    bytes: u64,
    since: Instant,
    pooled: Pooled,
}

/// Totals of a socket's ended sessions.
#[derive(Default, Clone)]
struct Ended {
    sessions: u64,
    ends: EndCounts,
    faults: u64,
    bytes: u64,
    latency: FaultLatency,
}

/// What the supervisor keeps up to date.
#[derive(Default)]
pub(super) struct Live {
    sessions: BTreeMap<u64, LiveSession>,
    ended: BTreeMap<usize, Ended>,
    refused: u64,
    dropped: u64,
    draining: bool,
}

/// Reads a server's status from any thread.
#[derive(Clone)]
pub struct StatusHandle {
    live: Arc<Mutex<Live>>,
    sockets: Arc<Vec<(PathBuf, PathBuf)>>,
    threads: (usize, usize),
    t0: Instant,
    #[cfg(feature = "store")]
    frames: Arc<Vec<Arc<crate::store::Frames>>>,
}

impl std::fmt::Debug for StatusHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusHandle")
            .field("sockets", &self.sockets.len())
            .finish()
    }
}

impl StatusHandle {
    /// The status of a server of `sockets` (each its path and memory file's) whose pool
    /// has `threads` (serving faults, prefetching).
    pub(super) fn new(sockets: Vec<(PathBuf, PathBuf)>, threads: (usize, usize)) -> StatusHandle {
        StatusHandle {
            live: Arc::new(Mutex::new(Live::default())),
            sockets: Arc::new(sockets),
            threads,
            t0: Instant::now(),
            #[cfg(feature = "store")]
            frames: Arc::new(Vec::new()),
        }
    }

    /// Counts fetches through `frames` too (the sockets' snapshots in the store).
    #[cfg(feature = "store")]
    pub(super) fn with_frames(mut self, frames: Vec<Arc<crate::store::Frames>>) -> StatusHandle {
        let mut distinct: Vec<Arc<crate::store::Frames>> = Vec::new();
        for f in frames {
            if !distinct.iter().any(|d| Arc::ptr_eq(d, &f)) {
                distinct.push(f);
            }
        }
        self.frames = Arc::new(distinct);
        self
    }

    fn with<T>(&self, f: impl FnOnce(&mut Live) -> T) -> T {
        f(&mut self.live.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A VM admitted.
    pub(super) fn started(
        &self,
        id: u64,
        socket: usize,
        pid: Option<i32>,
        bytes: u64,
        pooled: Pooled,
    ) {
        self.with(|l| {
            l.sessions.insert(
                id,
                LiveSession {
                    socket,
                    pid,
                    bytes,
                    since: Instant::now(),
                    pooled,
                },
            )
        });
    }

    /// A VM's session ended, as `end` says, its engine having done `engine`.
    pub(super) fn ended(&self, id: u64, end: &SessionEnd, engine: &LazyReport) {
        self.with(|l| {
            let Some(s) = l.sessions.remove(&id) else {
                return;
            };
            let e = l.ended.entry(s.socket).or_default();
            e.sessions += 1;
            e.ends.count(end);
            e.faults += engine.faults;
            e.bytes += engine.bytes_copied;
            e.latency = e.latency.merge(&engine.fault_latency);
        });
    }

    /// A VM refused (and ended).
    pub(super) fn refused(&self) {
        self.with(|l| l.refused += 1);
    }

    /// A connection dropped that was not a VM's.
    pub(super) fn dropped(&self) {
        self.with(|l| l.dropped += 1);
    }

    /// The server began to drain.
    pub(super) fn draining(&self) {
        self.with(|l| l.draining = true);
    }

    /// The status now.
    pub fn snapshot(&self) -> ServerStatus {
        // What the lock guards, copied; each VM's report (its latest fault times copied and
        // sorted among them) is made after, so the supervisor's admissions and ends never
        // wait on a scrape (until 2026-11-29 they waited for every VM's report).
        let (live, ended, draining, refused, dropped) = self.with(|l| {
            let live: Vec<(u64, usize, Option<i32>, u64, Instant, Pooled)> = l
                .sessions
                .iter()
                .map(|(&id, s)| (id, s.socket, s.pid, s.bytes, s.since, s.pooled.clone()))
                .collect();
            (live, l.ended.clone(), l.draining, l.refused, l.dropped)
        });
        let sessions: Vec<SessionStatus> = live
            .into_iter()
            .map(|(id, socket, pid, bytes, since, pooled)| SessionStatus {
                id,
                socket,
                pid,
                bytes,
                age_secs: since.elapsed().as_secs_f64(),
                engine: pooled.report(),
            })
            .collect();
        let sockets = self
            .sockets
            .iter()
            .enumerate()
            .map(|(i, (path, mem))| {
                let mut t = ended.get(&i).cloned().unwrap_or_default();
                let live = sessions.iter().filter(|s| s.socket == i);
                let mut serving = 0;
                for s in live {
                    serving += 1;
                    t.sessions += 1;
                    t.faults += s.engine.faults;
                    t.bytes += s.engine.bytes_copied;
                    t.latency = t.latency.merge(&s.engine.fault_latency);
                }
                SocketStatus {
                    socket: i,
                    path: path.clone(),
                    mem_file: mem.clone(),
                    serving,
                    sessions: t.sessions,
                    ended: t.ends,
                    faults: t.faults,
                    bytes_copied: t.bytes,
                    fault_latency: t.latency,
                }
            })
            .collect();
        ServerStatus {
            uptime_secs: self.t0.elapsed().as_secs_f64(),
            draining,
            pool_threads: self.threads.0,
            prefetch_threads: self.threads.1,
            sockets,
            sessions,
            refused,
            dropped,
            #[cfg(feature = "store")]
            store: (!self.frames.is_empty()).then(|| crate::store::StoreStatus::of(&self.frames)),
        }
    }
}
