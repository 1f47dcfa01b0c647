//! The page server: its sockets (a snapshot each), its one intake, its pool, the VMs it
//! serves, and the supervisor loop ([`Server::run`]) that ties them together. Read top to
//! bottom, this file is the whole life of a server: start, watch, drain or hand over,
//! report; `sessions.rs` a VM's session in it (admitted or refused, then ended), and
//! `resume.rs` the VMs it takes back or hands on (a restart, a hand-over, a drain).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::config::{ServerConfig, Setting, Vms};
use super::files::MemoryFile;
use super::handoff;
use super::handshake::HandshakeError;
use super::intake::{Closed, Intake, MAX_PENDING_HANDSHAKES};
use super::learn::Learnt;
use super::listener::Listener;
use super::peer::Ending;
use super::pool::{Pool, PrefetchHold};
use super::report::{SessionEnd, SessionReport};
use super::session::Session;
use super::state::{SessionRecord, StateDir};
use super::status::{ServerStatus, StatusHandle};
use super::takeover::TakeOver;
use super::watch::FileWatch;
use super::ServeError;
use crate::restore::Regaining;
use crate::sys::PollFd;

mod files;
mod resume;
mod sessions;

/// How long a drain waits for handshakes in flight before it stops waiting (Firecracker
/// sends its handshake in one message as it connects; a connection still silent by then
/// is not a VM about to be served, and one that completes later is ended).
pub(super) const DRAIN_HANDSHAKE_GRACE: Duration = Duration::from_secs(1);

/// One snapshot, served to every VM that connects to its socket.
#[derive(Debug)]
pub struct Socket {
    /// Where VMs connect.
    pub listener: Listener,
    /// The snapshot's memory file.
    pub memory: MemoryFile,
    /// Memory-file offsets to prefetch first for each VM (a recorded working set; empty:
    /// what was learnt, with [`ServerConfig::learn_working_sets`], else address order).
    pub working_set: Vec<u64>,
}

/// A socket as the server keeps it.
struct Served {
    /// `None` once it stopped listening.
    listener: Option<Listener>,
    memory: MemoryFile,
    working_set: Vec<u64>,
    /// What its VMs taught (empty unless learning).
    learnt: Mutex<Option<Learnt>>,
    /// Its memory file changed while served: it takes no more VMs.
    retired: bool,
}

impl Served {
    /// The blocks to prefetch first for a VM of this socket: its given working set, else
    /// what was learnt.
    fn working_set(&self) -> Vec<u64> {
        if !self.working_set.is_empty() {
            return self.working_set.clone();
        }
        self.learnt
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map_or(Vec::new(), |l| l.offsets().to_vec())
    }

    /// Merges a VM's working set into what was learnt (when learning); a failure to keep
    /// it is logged.
    fn learn(&self, ws: &[u64], ending: &Ending) {
        let mut g = self.learnt.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = g.as_mut() {
            if let Err(e) = l.learn(ws) {
                ending.log.say(&format!(
                    "learnt working set {}: not written: {e}",
                    l.path().display()
                ));
            }
        }
    }
}

/// Tells a running [`Server`] to drain (stop accepting, graduate every VM, return), or to
/// hand everything to a new server ([`super::take_over`]).
#[derive(Debug, Clone)]
pub struct Drainer {
    drain: Arc<OwnedFd>,
    handoff: Arc<HandoffSlot>,
}

/// A hand-off asked for: the new server's connection (and what it asked for), and an
/// eventfd that says so.
#[derive(Debug)]
struct HandoffSlot {
    to: Mutex<Option<(UnixStream, super::handoff::Asked)>>,
    ready: OwnedFd,
}

impl Drainer {
    /// Asks the server to drain (any thread; a second call changes nothing).
    pub fn drain(&self) {
        let _ = crate::sys::eventfd_signal(self.drain.as_fd());
    }

    /// Asks the server to hand its sockets and VMs to the server on the other end of `to`,
    /// as it `asked`.
    pub(super) fn hand_off(&self, to: UnixStream, asked: super::handoff::Asked) {
        *self.handoff.to.lock().unwrap_or_else(|e| e.into_inner()) = Some((to, asked));
        let _ = crate::sys::eventfd_signal(self.handoff.ready.as_fd());
    }
}

/// Where a one-VM server is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum One {
    /// Waiting for its VM, until then (`None`: for ever).
    Waiting(Option<Instant>),
    /// Its VM was admitted.
    Serving,
}

/// Which VM and userfaultfd a session record is of (a process may hold several VMs' worth
/// of userfaultfds, as the test rigs do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RecordKey {
    pid: i32,
    start_time: u64,
    uffd_fd: i32,
}

impl RecordKey {
    fn of(r: &SessionRecord) -> RecordKey {
        RecordKey {
            pid: r.pid,
            start_time: r.start_time,
            uffd_fd: r.uffd_fd,
        }
    }
}

/// What woke the supervisor.
struct Woken {
    /// Sockets with connections waiting.
    listening: Vec<usize>,
    /// Sessions whose link or failure descriptor changed.
    watched: Vec<u64>,
}

/// What a server did, once it stopped.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServerReport {
    /// Its status as it stopped: per socket, the VMs admitted and how their sessions ended,
    /// with the faults and bytes served and the fault latency, all VMs together; VMs
    /// refused, connections dropped.
    pub status: ServerStatus,
    /// The session that ended last (with [`Vms::One`], the VM served).
    pub last: Option<SessionReport>,
}

/// A page server (see the module docs of `serve`).
pub struct Server {
    sockets: Vec<Served>,
    cfg: ServerConfig,
    ending: Ending,
    intake: Intake,
    drain: Arc<OwnedFd>,
    handoff: Arc<HandoffSlot>,
    pool: Pool,
    status: StatusHandle,
    /// What the server this one took over from handed over, served from `run` on (ended
    /// if this server is dropped before).
    handed: Vec<TakeOver>,
    watch: Option<FileWatch>,
    state: Option<StateDir>,
    sessions: BTreeMap<u64, Session>,
    next_id: u64,
    served_bytes: u64,
    /// Collapses of ended sessions, stopped but not yet ended: waited for before `run`
    /// returns, so none is cut off mid-chunk by the process exiting.
    collapses: Vec<Regaining>,
    /// The session that ended last.
    last: Option<SessionReport>,
    /// With [`Vms::One`]: where it is.
    one: Option<One>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("sockets", &self.sockets.len())
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

impl Server {
    /// Checks the settings and starts the pool; nothing is accepted before [`Server::run`].
    pub fn new(sockets: Vec<Socket>, cfg: ServerConfig) -> Result<Server, ServeError> {
        cfg.check()?;
        let one_allowed = !matches!(cfg.vms, Vms::One { .. }) || sockets.len() == 1;
        if sockets.is_empty() || !one_allowed {
            return Err(ServeError::Setting {
                setting: Setting::Sockets,
                value: sockets.len() as u64,
                allowed: "a server needs at least one socket, and a server of one VM exactly one",
            });
        }
        let ending = Ending {
            on_failure: cfg.on_failure,
            log: cfg.log.clone(),
        };
        let drain = Arc::new(crate::sys::eventfd().map_err(ServeError::io("make an eventfd"))?);
        let handoff = Arc::new(HandoffSlot {
            to: Mutex::new(None),
            ready: crate::sys::eventfd().map_err(ServeError::io("make an eventfd"))?,
        });
        let pool = Pool::start(cfg.handler_threads, cfg.prefetch_threads)
            .map_err(ServeError::io("start the serving threads"))?;
        let state = cfg.state_dir.as_deref().map(StateDir::open).transpose()?;
        let names = sockets
            .iter()
            .map(|s| {
                (
                    s.listener.path().to_path_buf(),
                    s.memory.path().to_path_buf(),
                )
            })
            .collect();
        let sockets: Vec<Served> = sockets
            .into_iter()
            .map(|s| Served {
                listener: Some(s.listener),
                memory: s.memory,
                working_set: s.working_set,
                learnt: Mutex::new(None),
                retired: false,
            })
            .collect();
        let status = StatusHandle::new(names, pool.threads());
        #[cfg(feature = "store")]
        let status = status.with_frames(
            sockets
                .iter()
                .filter_map(|s| s.memory.frames().cloned())
                .collect(),
        );
        let intake = Intake::new(cfg.handshake_timeout, ending.clone(), status.clone())?;
        let one = match cfg.vms {
            Vms::Every => None,
            Vms::One { wait } => Some(One::Waiting(wait.map(|w| Instant::now() + w))),
        };
        Ok(Server {
            sockets,
            ending,
            intake,
            drain,
            handoff,
            status,
            pool,
            cfg,
            handed: Vec::new(),
            watch: None,
            state,
            sessions: BTreeMap::new(),
            next_id: 0,
            served_bytes: 0,
            collapses: Vec::new(),
            last: None,
            one,
        })
    }

    /// Serves, from [`Server::run`] on, the VMs a server handed over
    /// ([`super::take_over`]); the listening sockets it handed are given as this server's
    /// sockets ([`TakeOver::listener`]).
    /// Confirms the take-over first if it is not ([`TakeOver::confirm`], against this
    /// server's memory files; a server with a state directory must have confirmed it before
    /// [`Server::new`]). Where it cannot be, nothing is taken: the old server serves on.
    pub fn adopt(&mut self, mut t: TakeOver) -> Result<(), ServeError> {
        if !t.confirmed() {
            let mems: Vec<&MemoryFile> = self.sockets.iter().map(|s| &s.memory).collect();
            t.confirm(&mems, self.cfg.state_dir.as_deref(), handoff::EXIT_WAIT)?;
        }
        // The handed sockets are this server's alone now: their paths go when it stops.
        for s in &mut self.sockets {
            if let Some(l) = &mut s.listener {
                l.own_path();
            }
        }
        self.handed.push(t);
        Ok(())
    }

    /// A handle that makes [`Server::run`] drain and return.
    pub fn drainer(&self) -> Drainer {
        Drainer {
            drain: self.drain.clone(),
            handoff: self.handoff.clone(),
        }
    }

    /// Holds back every VM's prefetch on the pool's prefetch threads until the hold is
    /// dropped (the step a prefetch thread is on finishes; faults are served as ever). For
    /// a VM that must not share the CPUs with its prefetch yet: one loaded but not yet
    /// running, whose load and resume are a move's pause. Not held: a VM's graduation
    /// when the server drains (its own threads bring the rest in, so a drain never waits
    /// on a hold), and the first read-ahead a working set asks for when a VM connects.
    pub fn hold_prefetch(&self) -> PrefetchHold {
        self.pool.hold()
    }

    /// A handle that reads the server's status from any thread (and serves it on a control
    /// socket or a metrics address).
    pub fn status(&self) -> StatusHandle {
        self.status.clone()
    }

    /// Serves until drained ([`Drainer::drain`]) or handed over, or with [`Vms::One`] until
    /// its VM goes; then every VM still served graduates (all its blocks in, then its
    /// ranges unregistered, so it depends on neither this server nor the memory file) and
    /// the report is returned. Blocks in `poll`: an idle server uses no CPU.
    ///
    /// With a [`ServerConfig::state_dir`], it first takes back every VM a server that died
    /// was serving from the same memory files: each VM's userfaultfd comes back from the VM
    /// itself (`pidfd_getfd`), pages already in are left as they are, and threads that
    /// waited are woken to fault again. A VM that cannot be taken back (its memory file was
    /// replaced or truncated, its descriptor is gone) is ended as the policy says.
    ///
    /// With [`Vms::One`], an error is returned when its VM is refused or its serving fails
    /// (the VM having been ended as the policy says), or when no VM came in time.
    pub fn run(mut self) -> Result<ServerReport, ServeError> {
        self.watch_files();
        self.load_learnt();
        let (handed, dropped) = self.resume_handed();
        self.resume_recorded(&handed, &dropped);
        let mut draining: Option<Instant> = None;
        loop {
            if let Some(done) = self.one_done() {
                return done.and_then(|()| self.finish());
            }
            let Woken { listening, watched } = self.wait(draining);
            for i in listening {
                if let Some(l) = &self.sockets[i].listener {
                    self.intake.accept(i, l, MAX_PENDING_HANDSHAKES);
                }
            }
            self.admit_arrivals()?;
            for id in watched {
                self.check_session(id);
            }
            if draining.is_none() && crate::sys::is_readable(self.drain.as_fd()) {
                draining = Some(Instant::now() + DRAIN_HANDSHAKE_GRACE);
                self.begin_drain();
            }
            if let Some(deadline) = draining {
                let pending = self.intake.pending();
                if pending == 0 || Instant::now() >= deadline {
                    for a in self.intake.close(Closed::Draining) {
                        let _ = self.arrive(a);
                    }
                    if pending > 0 {
                        self.ending.log.say(&format!(
                            "draining: {pending} connections still silent after {:.1} s are \
                             not waited for",
                            DRAIN_HANDSHAKE_GRACE.as_secs_f64()
                        ));
                    }
                    break;
                }
            }
            let changed = match &mut self.watch {
                Some(w) if crate::sys::is_readable(w.fd()) => {
                    let mems: Vec<&MemoryFile> = self.sockets.iter().map(|s| &s.memory).collect();
                    w.changed(&mems)
                }
                _ => Vec::new(),
            };
            for i in changed {
                self.file_changed(i);
            }
            if crate::sys::is_readable(self.handoff.ready.as_fd()) && self.hand_off_asked()? {
                return self.finish();
            }
        }
        self.graduate_all();
        self.finish()
    }

    /// Admits every VM whose handshake has ended. A one-VM server that had its VM and
    /// cannot serve it stops listening and returns the error.
    pub(super) fn admit_arrivals(&mut self) -> Result<(), ServeError> {
        while let Some(a) = self.intake.take() {
            let refused = self.arrive(a);
            if let (Err(e), Some(One::Waiting(_))) = (refused, self.one) {
                // A one-VM server had its VM and cannot serve it.
                self.stop_listening(Closed::HasItsVm);
                return Err(e);
            }
            self.one_admitted();
        }
        Ok(())
    }

    /// The report, once every collapse this server stopped has ended.
    fn finish(mut self) -> Result<ServerReport, ServeError> {
        for r in self.collapses.drain(..) {
            r.stop();
            r.wait();
        }
        Ok(ServerReport {
            status: self.status.snapshot(),
            last: self.last.take(),
        })
    }

    /// Whether a one-VM server serves its VM now.
    fn serving_one(&self) -> bool {
        matches!(self.one, Some(One::Waiting(_))) && !self.sessions.is_empty()
    }

    /// A one-VM server admitted its VM: it stops listening.
    fn one_admitted(&mut self) {
        if self.serving_one() {
            self.one = Some(One::Serving);
            self.stop_listening(Closed::HasItsVm);
        }
    }

    /// Whether a one-VM server is done: its VM went (the result), or none came in time.
    fn one_done(&mut self) -> Option<Result<(), ServeError>> {
        match self.one? {
            One::Serving if self.sessions.is_empty() => {
                let failed = match self.last.as_ref().map(|l| &l.end) {
                    Some(SessionEnd::Failed(e)) => Some(e.clone()),
                    _ => None,
                };
                Some(match failed {
                    None => Ok(()),
                    Some(e) => {
                        self.last = None;
                        Err(Arc::try_unwrap(e).unwrap_or_else(ServeError::Reported))
                    }
                })
            }
            One::Waiting(Some(until)) if Instant::now() >= until && self.intake.pending() == 0 => {
                self.stop_listening(Closed::HasItsVm);
                let Vms::One { wait } = self.cfg.vms else {
                    return None;
                };
                Some(Err(HandshakeError::NoVm(wait.unwrap_or_default()).into()))
            }
            _ => None,
        }
    }

    /// Stops listening on every socket: paths first (new VMs are refused at `connect`),
    /// then every connection already in a backlog is accepted (its VM may have sent its
    /// userfaultfd and would wait for ever; it is admitted or ended), then the sockets
    /// close, and the intake takes no more VMs: a handshake that completes later ends its
    /// own VM, told `why`.
    fn stop_listening(&mut self, why: Closed) {
        for s in &self.sockets {
            if let Some(l) = &s.listener {
                l.unpublish();
            }
        }
        for (i, s) in self.sockets.iter().enumerate() {
            if let Some(l) = &s.listener {
                self.intake.accept(i, l, usize::MAX);
            }
        }
        for s in &mut self.sockets {
            s.listener = None;
        }
        if why == Closed::HasItsVm {
            for a in self.intake.close(why) {
                self.intake.end(a, why);
            }
        }
    }

    /// A drain's first step: the sockets close (see [`Server::stop_listening`]); handshakes
    /// in flight are waited for (at most [`DRAIN_HANDSHAKE_GRACE`]) and admitted.
    fn begin_drain(&mut self) {
        self.status.draining();
        self.stop_listening(Closed::Draining);
        self.ending.log.say(&format!(
            "draining: sockets closed; {} VMs to graduate",
            self.sessions.len()
        ));
    }

    /// Blocks until something needs the supervisor: which sockets have connections waiting,
    /// and which sessions' descriptors changed. Waits for ever but during a drain's grace,
    /// or while a one-VM server waits for its VM until a deadline.
    fn wait(&self, draining: Option<Instant>) -> Woken {
        let deadline = match (draining, self.one) {
            (Some(d), _) => Some(d),
            // Past it with handshakes still being read: their ends wake the intake's fd (a
            // deadline gone by would make every wait return at once).
            (None, Some(One::Waiting(Some(until)))) if Instant::now() >= until => None,
            (None, Some(One::Waiting(until))) => until,
            _ => None,
        };
        // Full of handshakes none of which is silent long enough to drop yet: look again
        // when one will be.
        let deadline = deadline.into_iter().chain(self.intake.room_at()).min();
        // Once draining, the drain eventfd stays readable: left out, or every wait returns
        // at once.
        let mut fds = vec![
            match draining {
                Some(_) => PollFd::skip(),
                None => PollFd::readable(self.drain.as_fd()),
            },
            PollFd::readable(self.intake.fd()),
            PollFd::readable(self.handoff.ready.as_fd()),
            match &self.watch {
                Some(w) => PollFd::readable(w.fd()),
                None => PollFd::skip(),
            },
        ];
        const FIXED: usize = 4;
        let accepting = self.intake.has_room();
        let mut listening = Vec::new();
        for (i, s) in self.sockets.iter().enumerate() {
            if let (Some(l), true) = (&s.listener, accepting) {
                listening.push(i);
                fds.push(PollFd::readable(l.socket().as_fd()));
            }
        }
        let mut ids = Vec::new();
        for (&id, s) in &self.sessions {
            ids.push(id);
            fds.extend(s.watch());
        }
        let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if let Err(e) = crate::sys::poll(&mut fds, timeout) {
            // ENOMEM, say: the sessions must go on being watched; wait a little rather than
            // return with VMs that depend on this server.
            self.ending
                .log
                .say(&format!("poll failed: {e}; trying again in 100 ms"));
            std::thread::sleep(Duration::from_millis(100));
        }
        self.intake.clear();
        let base = FIXED + listening.len();
        let listening = listening
            .iter()
            .enumerate()
            .filter(|&(k, _)| fds[FIXED + k].ready())
            .map(|(_, &i)| i)
            .collect();
        let watched = ids
            .iter()
            .enumerate()
            .filter(|&(k, _)| fds[base + 2 * k].ready() || fds[base + 2 * k + 1].ready())
            .map(|(_, &id)| id)
            .collect();
        Woken { listening, watched }
    }
}
