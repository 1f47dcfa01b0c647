//! How a page server is set: its settings and their limits, what it does with a VM it can
//! no longer serve, and where its log lines go.

use std::sync::Arc;
use std::time::Duration;

use super::{
    ServeError, DEFAULT_BLOCK_BYTES, DEFAULT_HANDSHAKE_TIMEOUT, MAX_BLOCK_BYTES, MAX_SERVE_THREADS,
};

/// A page server's setting, as [`ServeError::Setting`] names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// [`ServeConfig::block_bytes`].
    BlockBytes,
    /// [`ServeConfig::handler_threads`].
    HandlerThreads,
    /// [`ServeConfig::prefetch_threads`].
    PrefetchThreads,
    /// A fleet's sockets and its room for VMs.
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

/// A log line's destination.
type LogFn = Arc<dyn Fn(&str) + Send + Sync>;

/// Where a page server's log lines go: a callback per line, or nowhere.
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

    /// A line: to the callback, and as a `tracing` event (target `guestmem::serve`).
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
        let reason = e.reason.unwrap_or("");
        if e.failed {
            tracing::warn!(target: "guestmem::fleet", event = e.event, session, pid,
                socket = e.socket, bytes = e.bytes, reason, "{line}");
        } else {
            tracing::info!(target: "guestmem::fleet", event = e.event, session, pid,
                socket = e.socket, bytes = e.bytes, reason, "{line}");
        }
        if let Some(f) = &self.0 {
            f(line);
        }
    }
}

/// What a session event says ([`ServeLog::session`]).
pub(crate) struct SessionEvent<'a> {
    /// `start`, `end`, `refused`, `graduated`, `handed-off`, `taken-back`.
    pub(crate) event: &'static str,
    pub(crate) session: Option<u64>,
    pub(crate) pid: Option<i32>,
    pub(crate) socket: usize,
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

/// How to serve.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Threads reading faults.
    pub handler_threads: usize,
    /// Threads prefetching (0: no prefetch; faults alone bring memory in).
    pub prefetch_threads: usize,
    /// Memory-file offsets to prefetch first, in order (a recorded working set).
    pub first: Vec<u64>,
    /// Bytes served per fault (raised to the largest page size; a multiple of it; at most
    /// [`MAX_BLOCK_BYTES`]).
    pub block_bytes: u64,
    /// What to do to a VM that sent its userfaultfd and then cannot be served.
    pub on_failure: OnFailure,
    /// How long a connected peer has to send its whole handshake before it is dropped (and
    /// the server listens on).
    pub handshake_timeout: Duration,
    /// How long to wait for a VM to connect (`None`: for ever).
    pub accept_timeout: Option<Duration>,
    /// Where log lines go: connections dropped, peers refused or ended, and why.
    pub log: ServeLog,
    /// Once every block of a VM's 4 KiB memory is in, collapse it to transparent huge
    /// pages in the VM's process (`process_madvise(MADV_COLLAPSE)` through its pidfd), in
    /// the background from [`REGAIN_SETTLE`](crate::restore::REGAIN_SETTLE) later, 2 MiB
    /// at a time, only where every page is present.
    pub regain_huge: bool,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            handler_threads: crate::jobs::default_threads(),
            prefetch_threads: crate::jobs::default_threads(),
            first: Vec::new(),
            block_bytes: DEFAULT_BLOCK_BYTES,
            on_failure: OnFailure::Kill,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            accept_timeout: None,
            log: ServeLog::default(),
            regain_huge: true,
        }
    }
}

impl ServeConfig {
    /// Checks the settings, before anything listens.
    pub fn check(&self) -> Result<(), ServeError> {
        let setting = |setting, value: u64, allowed| ServeError::Setting {
            setting,
            value,
            allowed,
        };
        if self.block_bytes == 0 || self.block_bytes > MAX_BLOCK_BYTES {
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
        Ok(())
    }
}
