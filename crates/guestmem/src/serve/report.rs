//! What a page server says of each VM it served: how its session ended, and what was done
//! for it. A server keeps the last of these and totals (`status.rs`), never a list of every
//! VM it served: its memory is bounded by the VMs it serves now, however long it runs.

use std::sync::Arc;

use super::ServeError;
use crate::restore::LazyReport;

/// How a VM's session ended.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SessionEnd {
    /// The VM closed its socket.
    PeerClosed,
    /// The VM's process (its address space) went.
    PeerExited,
    /// Drained: every block was brought in and its ranges unregistered.
    Graduated,
    /// Handed to a new server, which serves it on.
    HandedOff,
    /// Serving it failed, or its memory file changed under it; the VM was handled as
    /// [`super::ServerConfig::on_failure`] says. The error.
    Failed(#[serde(serialize_with = "as_text")] Arc<ServeError>),
}

impl SessionEnd {
    /// Its name in logs and counts.
    pub fn name(&self) -> &'static str {
        match self {
            SessionEnd::PeerClosed => "peer-closed",
            SessionEnd::PeerExited => "peer-exited",
            SessionEnd::Graduated => "graduated",
            SessionEnd::HandedOff => "handed-off",
            SessionEnd::Failed(_) => "failed",
        }
    }
}

impl std::fmt::Display for SessionEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionEnd::Failed(e) => write!(f, "failed: {e}"),
            other => f.write_str(other.name()),
        }
    }
}

fn as_text<S: serde::Serializer>(e: &Arc<ServeError>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(e)
}

/// One VM's session, as it ended.
#[derive(Debug, Clone, serde::Serialize)]
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
    /// What the engine did for it.
    pub engine: LazyReport,
    /// From admission to the end, seconds.
    pub served_secs: f64,
    /// The memory-file offsets of the blocks the VM faulted, first fault first: a working
    /// set for the snapshot's later VMs (`guestmem serve-uffd --record` writes it).
    #[serde(skip)]
    pub working_set: Vec<u64>,
}
