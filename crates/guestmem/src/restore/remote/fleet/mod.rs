//! One page server for many VMs: every VM that connects to any of its sockets is served,
//! side by side, until the server is told to drain.
//!
//! A socket per snapshot ([`FleetSocket`]: a [`Listener`] and its memory file). One
//! supervisor thread ([`Fleet::run`]) blocks in `poll` on the drain eventfd, the sockets,
//! the handshakes' results and every session's peer socket and failure descriptor; it
//! admits VMs (within [`FleetConfig::max_sessions`] and [`FleetConfig::max_bytes`]), and
//! ends sessions whose VM went or whose serving failed. Faults are served by one shared
//! pool of threads ([`FleetConfig::serve`]'s `handler_threads`; see `pool.rs`), not by
//! threads per VM, with each VM's userfaultfd as its own queue, served a batch per turn.
//!
//! Failure is per VM: a VM refused after it sent its userfaultfd (its handshake does not
//! hold together, its regions do not fit the memory file, a limit is reached) or whose
//! serving fails is ended as [`ServeConfig::on_failure`] says, through the pidfd taken when
//! it connected, with a log line; the others are untouched and the server goes on.
//!
//! Draining ([`Drainer::drain`], SIGTERM in the CLI): the sockets close at once (their
//! paths removed), handshakes in flight finish and are admitted, and then every VM
//! graduates: every block not yet in is brought in (faults still first, through the pool),
//! and only once all are in are its ranges unregistered from its userfaultfd, so the VM
//! depends on neither this server nor the memory file, which may then be deleted.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod expose;
mod graduate;
mod handoff;
mod intake;
mod learn;
#[cfg(feature = "metrics")]
mod metrics;
mod restart;
mod session;
mod status;
mod watch;

pub use expose::Exposed;
pub use handoff::{take_over, TakeOver};
pub use status::{FleetStatus, SessionStatus, SocketStatus, StatusHandle};

use super::handshake::{Handshake, Refused};
use super::listen::MAX_PENDING_HANDSHAKES;
use super::pool::Pool;
use super::state::StateDir;
use super::{Listener, MemoryFile, PageServer, ServeConfig, ServeError, Setting};
use crate::restore::LazyReport;

/// Default most VMs served at once.
pub const DEFAULT_MAX_SESSIONS: usize = 256;

/// One snapshot, served to every VM that connects to its socket.
#[derive(Debug)]
pub struct FleetSocket {
    /// Where VMs connect.
    pub listener: Listener,
    /// The snapshot's memory file.
    pub mem: MemoryFile,
    /// Memory-file offsets to prefetch first for each VM (a recorded working set).
    pub first: Vec<u64>,
}

/// How a fleet serves.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Block size, prefetch threads per VM, failure policy, handshake timeout and log;
    /// `handler_threads` is the size of the pool shared by every VM; `first` and
    /// `accept_timeout` are not used (each socket has its own working set; a fleet waits
    /// until drained).
    pub serve: ServeConfig,
    /// Most VMs served at once; the next is refused (and ended) with the reason.
    pub max_sessions: usize,
    /// Most guest memory served at once, bytes, all VMs together (`None`: no limit).
    pub max_bytes: Option<u64>,
    /// Where to keep a record of each VM served, so that a server started after this one
    /// died takes the VMs back (`None`: a VM does not outlive its server). See
    /// [`Fleet::run`].
    pub state_dir: Option<std::path::PathBuf>,
    /// Learn each snapshot's working set from the VMs served (the blocks they faulted, first
    /// fault first, merged across VMs), keep it beside its memory file, and prefetch it for
    /// every later VM of that snapshot (see the `learn` module). A socket given its own
    /// working set (`FleetSocket::first`) uses that instead.
    pub learn_working_sets: bool,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            serve: ServeConfig::default(),
            max_sessions: DEFAULT_MAX_SESSIONS,
            max_bytes: None,
            state_dir: None,
            learn_working_sets: false,
        }
    }
}

/// Tells a running [`Fleet`] to drain: stop accepting, graduate every VM, return; or to
/// hand everything to a new server ([`take_over`]).
#[derive(Debug, Clone)]
pub struct Drainer {
    drain: Arc<OwnedFd>,
    handoff: Arc<HandoffSlot>,
}

/// A hand-off asked for: the new server's connection, and an eventfd that says so.
#[derive(Debug)]
struct HandoffSlot {
    to: Mutex<Option<UnixStream>>,
    ready: OwnedFd,
}

impl Drainer {
    /// Asks the fleet to drain (any thread; a second call changes nothing).
    pub fn drain(&self) {
        let _ = crate::sys::eventfd_signal(self.drain.as_fd());
    }

    /// Asks the fleet to hand its sockets and VMs to the server on the other end of `to`.
    pub(super) fn hand_off(&self, to: UnixStream) {
        *self.handoff.to.lock().unwrap_or_else(|e| e.into_inner()) = Some(to);
        let _ = crate::sys::eventfd_signal(self.handoff.ready.as_fd());
    }
}

/// How a VM's session ended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SessionEnd {
    /// The VM closed its socket.
    PeerClosed,
    /// The VM's address space went (it exited).
    PeerExited,
    /// Drained: every block was brought in and its ranges unregistered.
    Graduated,
    /// Handed to a new server, which serves it on.
    HandedOff,
    /// Refused at admission or ended by a failure; the VM was handled as
    /// [`ServeConfig::on_failure`] says. The reason.
    Failed(String),
}

/// One VM's session, as it ended.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SessionReport {
    /// The session's number, in the order VMs were admitted (from 0).
    pub id: u64,
    /// Which socket (index in the order given) the VM connected to.
    pub socket: usize,
    /// The VM's process id.
    pub pid: Option<i32>,
    /// Guest memory it declared, bytes.
    pub bytes: u64,
    /// How it ended.
    pub end: SessionEnd,
    /// What the engine did for it (absent for a VM refused before serving).
    pub engine: Option<LazyReport>,
    /// From admission to the end, seconds.
    pub served_secs: f64,
}

/// What a fleet did, once drained.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FleetReport {
    /// Every VM that sent its userfaultfd, admitted or refused, in the order they ended.
    pub sessions: Vec<SessionReport>,
    /// Connections dropped without harm: they sent no userfaultfd.
    pub dropped: u64,
    /// Threads in the fault-serving pool.
    pub pool_threads: usize,
    /// From the start until drained, seconds.
    pub secs: f64,
}

/// A VM being served.
struct Session {
    server: PageServer,
    socket: usize,
    bytes: u64,
    t0: Instant,
    /// Its record in the state directory.
    record: Option<std::path::PathBuf>,
}

/// What woke the supervisor.
struct Woken {
    /// Each listening socket, and whether connections wait on it.
    listening: Vec<(usize, bool)>,
    /// Sessions whose peer socket or failure descriptor changed.
    watched: Vec<u64>,
}

/// Handshakes' results, left by their threads for the supervisor.
#[derive(Default)]
struct Inbox {
    results: Mutex<InboxInner>,
    pending: AtomicUsize,
}

/// The results, and whether the fleet still takes them.
#[derive(Default)]
struct InboxInner {
    /// The fleet stopped waiting (a drain's grace ran out): a late VM ends itself.
    closed: bool,
    results: VecDeque<(usize, Result<Handshake, Refused>)>,
}

/// How long a drain waits for handshakes in flight before it stops waiting (Firecracker
/// sends its handshake in one message as it connects; a connection still silent by then
/// is not a VM about to be served, and one that completes later is ended).
const DRAIN_HANDSHAKE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// A page server for many VMs (see the module docs).
pub struct Fleet {
    listeners: Vec<Option<Listener>>,
    mems: Vec<MemoryFile>,
    firsts: Vec<Vec<u64>>,
    cfg: FleetConfig,
    drain: Arc<OwnedFd>,
    handoff: Arc<HandoffSlot>,
    notify: Arc<OwnedFd>,
    inbox: Arc<Inbox>,
    pool: Pool,
    status: StatusHandle,
    /// Each socket's learnt working set (empty unless learning).
    learnt: Arc<Mutex<Vec<learn::Learnt>>>,
    /// VMs handed over by the server this one took over from, served from `run` on.
    handed: Vec<handoff::HandedSession>,
    /// The records (pid, start time, userfaultfd number) of VMs handed over: the state
    /// directory's copies of them are not taken back a second time.
    adopted: std::collections::HashSet<(i32, u64, i32)>,
    /// The memory files, watched for changes while served.
    watch: Option<watch::FileWatch>,
    /// Sockets whose memory file changed while served: they take no more VMs.
    retired: Vec<bool>,
    state: Option<StateDir>,
    sessions: BTreeMap<u64, Session>,
    next_id: u64,
    served_bytes: u64,
    report: FleetReport,
    t0: Instant,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("sockets", &self.mems.len())
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

impl Fleet {
    /// Checks the settings and starts the pool; nothing is accepted before [`Fleet::run`].
    pub fn new(sockets: Vec<FleetSocket>, cfg: FleetConfig) -> Result<Fleet, ServeError> {
        cfg.serve.check()?;
        if sockets.is_empty() || cfg.max_sessions == 0 {
            return Err(ServeError::Setting {
                setting: Setting::Sockets,
                value: sockets.len().min(cfg.max_sessions) as u64,
                allowed: "a fleet needs at least one socket and room for one VM",
            });
        }
        let sock_err = |op: &str| {
            let op = op.to_string();
            move |source| ServeError::Socket { op, source }
        };
        let drain = Arc::new(crate::sys::eventfd().map_err(sock_err("make an eventfd"))?);
        let handoff = Arc::new(HandoffSlot {
            to: Mutex::new(None),
            ready: crate::sys::eventfd().map_err(sock_err("make an eventfd"))?,
        });
        let notify = Arc::new(crate::sys::eventfd().map_err(sock_err("make an eventfd"))?);
        let pool = Pool::start(cfg.serve.handler_threads)
            .map_err(sock_err("start the fault-serving pool"))?;
        let state = cfg.state_dir.as_deref().map(StateDir::open).transpose()?;
        let n_sockets = sockets.len();
        let mut mems = Vec::new();
        let mut firsts = Vec::new();
        let mut listeners = Vec::new();
        let mut names = Vec::new();
        for s in sockets {
            names.push((s.listener.path().to_path_buf(), s.mem.path().to_path_buf()));
            mems.push(s.mem);
            firsts.push(s.first);
            listeners.push(Some(s.listener));
        }
        Ok(Fleet {
            listeners,
            mems,
            firsts,
            drain,
            handoff,
            notify,
            inbox: Arc::new(Inbox::default()),
            report: FleetReport {
                sessions: Vec::new(),
                dropped: 0,
                pool_threads: pool.threads(),
                secs: 0.0,
            },
            status: StatusHandle::new(names, pool.threads()),
            learnt: Arc::new(Mutex::new(Vec::new())),
            handed: Vec::new(),
            adopted: std::collections::HashSet::new(),
            watch: None,
            retired: vec![false; n_sockets],
            pool,
            cfg,
            state,
            sessions: BTreeMap::new(),
            next_id: 0,
            served_bytes: 0,
            t0: Instant::now(),
        })
    }

    /// Serves, from [`Fleet::run`] on, the VMs a server handed over ([`take_over`]); the
    /// listening sockets it handed are given as this fleet's sockets
    /// ([`TakeOver::listener`]).
    pub fn adopt(&mut self, mut t: TakeOver) {
        self.handed.extend(t.take_sessions());
    }

    /// A handle that makes [`Fleet::run`] drain and return.
    pub fn drainer(&self) -> Drainer {
        Drainer {
            drain: self.drain.clone(),
            handoff: self.handoff.clone(),
        }
    }

    /// A handle that reads the fleet's status from any thread (and serves it on a control
    /// socket or a metrics address).
    pub fn status(&self) -> StatusHandle {
        self.status.clone()
    }

    /// Serves every VM that connects until drained; then every VM graduates (see the module
    /// docs) and the report is returned. Blocks in `poll`: an idle fleet uses no CPU.
    ///
    /// With a [`FleetConfig::state_dir`], it first takes back every VM a server that died
    /// was serving from the same memory files: each VM's userfaultfd comes back from the VM
    /// itself (`pidfd_getfd`), pages already in are left as they are, and threads that
    /// waited are woken to fault again. A VM that cannot be taken back (its memory file was
    /// replaced or truncated, its descriptor is gone) is ended as the policy says.
    pub fn run(mut self) -> Result<FleetReport, ServeError> {
        self.watch_files();
        self.load_learnt();
        self.resume_handed();
        self.resume_all();
        let mut draining: Option<Instant> = None;
        loop {
            let Woken { listening, watched } = self.wait(draining);
            if listening.iter().any(|&(_, ready)| ready) {
                for (i, ready) in listening {
                    if ready {
                        self.accept(i);
                    }
                }
            }
            self.take_results();
            for id in watched {
                self.check_session(id);
            }
            if draining.is_none() && readable(self.drain.as_fd()) {
                draining = Some(Instant::now() + DRAIN_HANDSHAKE_GRACE);
                self.begin_drain();
            }
            if let Some(deadline) = draining {
                let pending = self.inbox.pending.load(Ordering::Acquire);
                if pending == 0 || Instant::now() >= deadline {
                    self.close_inbox();
                    if pending > 0 {
                        self.cfg.serve.log.say(&format!(
                            "draining: {pending} connections still silent after {:.1} s are \
                             not waited for",
                            DRAIN_HANDSHAKE_GRACE.as_secs_f64()
                        ));
                    }
                    break;
                }
            }
            let changed = match (&mut self.watch, &self.mems) {
                (Some(w), mems) if readable(w.fd()) => w.changed(mems),
                _ => Vec::new(),
            };
            for i in changed {
                self.file_changed(i);
            }
            if readable(self.handoff.ready.as_fd()) {
                let to = self
                    .handoff
                    .to
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                if let Some(to) = to {
                    self.settle_handshakes();
                    self.hand_off(&to);
                    self.report.secs = self.t0.elapsed().as_secs_f64();
                    return Ok(self.report);
                }
            }
        }
        self.graduate_all();
        self.report.secs = self.t0.elapsed().as_secs_f64();
        Ok(self.report)
    }

    /// Starts watching the memory files (a failure is logged: the fleet serves all the same).
    fn watch_files(&mut self) {
        self.watch = match watch::FileWatch::new(&self.mems) {
            Ok(w) => Some(w),
            Err(e) => {
                self.cfg.serve.log.warn(&format!(
                    "memory files not watched ({e}): a file written in place while served \
                     would not be noticed"
                ));
                None
            }
        };
    }

    /// A drain's first step: paths first (new VMs are refused at connect), then every
    /// connection already in a backlog is accepted (its VM may have sent its userfaultfd and
    /// would wait for ever), then the sockets close.
    fn begin_drain(&mut self) {
        self.status.draining();
        for l in self.listeners.iter().flatten() {
            l.unpublish();
        }
        for i in 0..self.listeners.len() {
            self.accept_all(i);
        }
        for l in &mut self.listeners {
            *l = None;
        }
        self.cfg.serve.log.say(&format!(
            "draining: sockets closed; {} VMs to graduate",
            self.sessions.len()
        ));
    }

    /// Blocks until something needs the supervisor: which sockets have connections waiting,
    /// and which sessions' descriptors changed.
    fn wait(&self, draining: Option<Instant>) -> Woken {
        // The drain, handshake and hand-off eventfds come first.
        const FIXED: usize = 4;
        // Once draining, the drain eventfd stays readable: left out, or every wait returns
        // at once.
        let drain = if draining.is_some() {
            -1
        } else {
            self.drain.as_raw_fd()
        };
        // A drain waits on handshakes in flight until its grace runs out.
        let ms = draining.map_or(-1, |d| {
            d.saturating_duration_since(Instant::now())
                .as_millis()
                .clamp(1, 60_000) as i32
        });
        let mut fds = vec![
            libc::pollfd {
                fd: drain,
                events: libc::POLLIN,
                revents: 0,
            },
            pollin(self.notify.as_fd()),
            pollin(self.handoff.ready.as_fd()),
            libc::pollfd {
                fd: self.watch.as_ref().map_or(-1, |w| w.fd().as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let accepting = self.inbox.pending.load(Ordering::Acquire) < MAX_PENDING_HANDSHAKES;
        let mut listening = Vec::new();
        for (i, l) in self.listeners.iter().enumerate() {
            if let (Some(l), true) = (l, accepting) {
                listening.push(i);
                fds.push(pollin(l.socket().as_fd()));
            }
        }
        let mut ids = Vec::new();
        for (&id, s) in &self.sessions {
            ids.push(id);
            let [peer, changed] = s.server.watch_fds();
            let mut p = pollin(peer);
            p.events |= libc::POLLRDHUP;
            fds.push(p);
            fds.push(pollin(changed));
        }
        // SAFETY: `fds` is a live array of pollfds over descriptors borrowed from `self`;
        // no timeout (idle means blocked) but a drain's grace.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                // ENOMEM, say: the sessions must go on being watched; wait a little rather
                // than return with VMs that depend on this server.
                self.cfg
                    .serve
                    .log
                    .say(&format!("poll failed: {e}; trying again in 100 ms"));
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        drain_eventfd(self.notify.as_fd());
        let base = FIXED + listening.len();
        let listening = listening
            .iter()
            .enumerate()
            .map(|(k, &i)| (i, fds[FIXED + k].revents != 0))
            .collect();
        let watched = ids
            .iter()
            .enumerate()
            .filter(|(k, _)| fds[base + 2 * k].revents != 0 || fds[base + 2 * k + 1].revents != 0)
            .map(|(_, &id)| id)
            .collect();
        Woken { listening, watched }
    }
}

/// A pollfd waiting for `fd` to be readable.
fn pollin(fd: std::os::fd::BorrowedFd<'_>) -> libc::pollfd {
    libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Whether `fd` is readable now.
fn readable(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let mut p = pollin(fd);
    // SAFETY: one live pollfd; no waiting.
    unsafe { libc::poll(&mut p, 1, 0) == 1 }
}

/// Reads an eventfd's count (unreadable until signalled again).
fn drain_eventfd(fd: std::os::fd::BorrowedFd<'_>) {
    let mut buf = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a live buffer; the eventfd is non-blocking.
    unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, 8) };
}
