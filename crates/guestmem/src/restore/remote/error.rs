//! What a handshake or a page server refuses or fails with.

use std::io;
use std::path::PathBuf;

use super::{HandshakeError, Setting, SocketRefusal};
use crate::snapshot::SnapshotError;

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
    Handshake(#[from] HandshakeError),
    /// The memory file cannot serve the regions.
    #[error("memory file {}: {reason}", path.display())]
    MemoryFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A working-set file does not parse, names offsets outside the regions, or cannot be
    /// written where asked.
    #[error("working set {}: {reason}", path.display())]
    WorkingSet {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A setting is out of its range.
    #[error("{} {}: {allowed}", setting.name(), setting.show(*value))]
    Setting {
        /// The setting.
        setting: Setting,
        /// The value given.
        value: u64,
        /// What it may be, and why.
        allowed: &'static str,
    },
    /// The socket path cannot be listened on.
    #[error("--socket {}: {refusal}", path.display())]
    SocketPath {
        /// The path.
        path: PathBuf,
        /// Why not.
        refusal: SocketRefusal,
    },
    /// The state directory cannot be used.
    #[error("--state-dir {}: {reason}", path.display())]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// Why not.
        reason: String,
    },
    /// A VM was refused at a limit of the server.
    #[error(
        "refused at a limit: {limit}: {have} in use, this VM needs {needs}, the limit is {max}"
    )]
    Limit {
        /// What the limit counts.
        limit: &'static str,
        /// In use before this VM.
        have: u64,
        /// What this VM needs.
        needs: u64,
        /// The limit.
        max: u64,
    },
    /// Serving failed: the first error, naming the region, address and file offset.
    #[error("serving the peer's memory: {0}")]
    Serve(#[source] SnapshotError),
}
