//! How a page server is set: its settings and their limits, which VMs it serves, what it
//! does with a VM it can no longer serve, and where its log lines go.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::ServeError;
use crate::snapshot::{DEFAULT_BLOCK_BYTES, MAX_STAGED_BLOCK_BYTES};

/// Most threads of either kind one server starts.
pub const MAX_SERVE_THREADS: usize = 1024;
/// Default time a connected peer has to send its whole handshake.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default most VMs served at once.
pub const DEFAULT_MAX_VMS: usize = 256;

/// A page server's setting, as [`ServeError::Setting`] names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// [`ServerConfig::block_bytes`].
    BlockBytes,
    /// [`ServerConfig::handler_threads`].
    HandlerThreads,
    /// [`ServerConfig::prefetch_threads`].
    PrefetchThreads,
    /// The sockets given, and [`ServerConfig::max_vms`].
    Sockets,
}

impl Setting {
    /// How an error names it.
    pub fn name(self) -> &'static str {
        match self {
            Setting::BlockBytes => "block size",
            Setting::HandlerThreads => "handler threads",
            Setting::PrefetchThreads => "prefetch threads",
            Setting::Sockets => "sockets",
        }
    }

    /// A value of it as an error shows it: sizes in hex, counts in decimal.
    pub(super) fn show(self, value: u64) -> String {
        match self {
            Setting::BlockBytes => format!("{value:#x}"),
            _ => value.to_string(),
        }
    }
}

/// What a page server does to a VM it can no longer serve (its vCPUs would wait for ever on
/// memory that will not come).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// `SIGKILL` the VM's process through the pidfd taken when it connected (the default):
    /// it ends, with the reason logged, rather than hangs.
    #[default]
    Kill,
    /// Leave it (it hangs on the memory that never arrives); the reason is logged.
    Leave,
}

/// Which VMs a server serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Vms {
    /// Every VM that connects to any of its sockets, until drained (the default).
    #[default]
    Every,
    /// The first VM whose handshake completes: once it is admitted the server stops
    /// listening (the socket is closed and its path removed, so a second VM is refused at
    /// `connect`), and [`super::Server::run`] returns when that VM goes. Past `wait` with no
    /// VM, it gives up ([`super::HandshakeError::NoVm`]).
    One {
        /// How long to wait for a VM (`None`: for ever).
        wait: Option<Duration>,
    },
}

/// A log line's destination.
type LogFn = Arc<dyn Fn(&str) + Send + Sync>;

/// Where a page server's log lines go: a callback per line, or nowhere. Every line is also
/// a `tracing` event (target `guestmem::serve`).
#[derive(Clone, Default)]
pub struct ServeLog(Option<LogFn>);

impl ServeLog {
    /// Lines to standard error, each prefixed with `prefix`.
    pub fn stderr(prefix: &'static str) -> ServeLog {
        ServeLog(Some(Arc::new(move |m: &str| eprintln!("{prefix}{m}"))))
    }

    /// Lines to `f`.
    pub fn to(f: impl Fn(&str) + Send + Sync + 'static) -> ServeLog {
        ServeLog(Some(Arc::new(f)))
    }

    /// A line: to the callback, and as a `tracing` event.
    pub(crate) fn say(&self, line: &str) {
        tracing::info!(target: "guestmem::serve", "{line}");
        if let Some(f) = &self.0 {
            f(line);
        }
    }

    /// A line about a VM the server could not serve (a `tracing` warning).
    pub(crate) fn warn(&self, line: &str) {
        tracing::warn!(target: "guestmem::serve", "{line}");
        if let Some(f) = &self.0 {
            f(line);
        }
    }

    /// One structured event of a VM's session (its start, end, or failure) with `line`
    /// as its message: fields `event`, `session`, `pid`, `socket`, `bytes` and, for an
    /// end, `reason`.
    pub(crate) fn session(&self, e: &SessionEvent<'_>, line: &str) {
        let session = e.session.map_or(-1, |s| s as i64);
        let pid = e.pid.unwrap_or(-1);
        let socket = e.socket.map_or(-1, |s| s as i64);
        let reason = e.reason.unwrap_or("");
        if e.failed {
            tracing::warn!(target: "guestmem::serve", event = e.event, session, pid,
                socket, bytes = e.bytes, reason, "{line}");
        } else {
            tracing::info!(target: "guestmem::serve", event = e.event, session, pid,
                socket, bytes = e.bytes, reason, "{line}");
        }
        if let Some(f) = &self.0 {
            f(line);
        }
    }
}

/// What a session event says ([`ServeLog::session`]).
pub(crate) struct SessionEvent<'a> {
    /// `start`, `end`, `refused`, `graduated`, `handed-off`, `runs-on` (a VM that closed
    /// its socket and still holds its userfaultfd, served on until its process exits).
    pub(crate) event: &'static str,
    pub(crate) session: Option<u64>,
    pub(crate) pid: Option<i32>,
    pub(crate) socket: Option<usize>,
    pub(crate) bytes: u64,
    pub(crate) reason: Option<&'a str>,
    /// A failure (logged as a warning).
    pub(crate) failed: bool,
}

impl std::fmt::Debug for ServeLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ServeLog(on)"
        } else {
            "ServeLog(off)"
        })
    }
}

/// How a page server serves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Threads reading and serving faults, shared by every VM.
    pub handler_threads: usize,
    /// Threads prefetching, shared by every VM, below the faults in priority (0: no
    /// prefetch; only faults bring memory in).
    pub prefetch_threads: usize,
    /// Bytes served per fault (raised to the largest page size; a multiple of it; at most
    /// [`MAX_STAGED_BLOCK_BYTES`]: each serving thread stages one block).
    pub block_bytes: u64,
    /// Which VMs: every one until drained, or one.
    pub vms: Vms,
    /// Most VMs served at once; the next is refused (and ended) with the reason.
    pub max_vms: usize,
    /// Most guest memory served at once, bytes, all VMs together (`None`: no limit).
    pub max_bytes: Option<u64>,
    /// What to do to a VM that sent its userfaultfd and then cannot be served.
    pub on_failure: OnFailure,
    /// How long a connected peer has to send its whole handshake before it is dropped (and
    /// the server listens on).
    pub handshake_timeout: Duration,
    /// Where to keep a record of each VM served, so that a server started after this one
    /// died takes the VMs back (`None`: a VM does not outlive its server). See
    /// [`super::Server::run`].
    pub state_dir: Option<PathBuf>,
    /// Learn each snapshot's working set from the VMs served (the blocks they faulted, first
    /// fault first, merged across VMs), keep it beside its memory file, and prefetch it for
    /// every later VM of that snapshot (see the `learn` module). A socket given its own
    /// working set ([`super::Socket::working_set`]) uses that instead.
    pub learn_working_sets: bool,
    /// Once every block of a VM's 4 KiB memory is in, collapse it to transparent huge
    /// pages in the VM's process (`process_madvise(MADV_COLLAPSE)` through its pidfd), in
    /// the background from [`REGAIN_SETTLE`](crate::restore::REGAIN_SETTLE) later, 2 MiB
    /// at a time, only where every page is present. A collapse ends when its VM's session
    /// does (after the chunk it is on).
    pub regain_huge: bool,
    /// Where log lines go: connections dropped, VMs admitted, refused or ended, and why.
    pub log: ServeLog,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            handler_threads: crate::jobs::default_threads(),
            prefetch_threads: 1,
            block_bytes: DEFAULT_BLOCK_BYTES,
            vms: Vms::Every,
            max_vms: DEFAULT_MAX_VMS,
            max_bytes: None,
            on_failure: OnFailure::Kill,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            state_dir: None,
            learn_working_sets: false,
            regain_huge: true,
            log: ServeLog::default(),
        }
    }
}

impl ServerConfig {
    /// Checks the settings, before anything listens.
    pub fn check(&self) -> Result<(), ServeError> {
        let setting = |setting, value: u64, allowed| ServeError::Setting {
            setting,
            value,
            allowed,
        };
        if self.block_bytes == 0 || self.block_bytes > MAX_STAGED_BLOCK_BYTES {
            return Err(setting(
                Setting::BlockBytes,
                self.block_bytes,
                "must be from 1 byte (raised to a page) to 0x4000000 (64 MiB: each serving \
                 thread stages one block)",
            ));
        }
        if self.handler_threads == 0 || self.handler_threads > MAX_SERVE_THREADS {
            return Err(setting(
                Setting::HandlerThreads,
                self.handler_threads as u64,
                "must be 1 to 1024",
            ));
        }
        if self.prefetch_threads > MAX_SERVE_THREADS {
            return Err(setting(
                Setting::PrefetchThreads,
                self.prefetch_threads as u64,
                "at most 1024",
            ));
        }
        if self.max_vms == 0 {
            return Err(setting(
                Setting::Sockets,
                0,
                "a server needs room for at least one VM",
            ));
        }
        Ok(())
    }
}
