//! What a handshake or a page server refuses or fails with: one enum, each variant naming
//! the region, address, file or limit at fault, its reasons typed (code that acts on an
//! error matches a variant, never its text). No message names a command-line flag: the
//! command adds its flags when it reports.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use super::{HandshakeError, Setting, SocketRefusal};
use crate::snapshot::SnapshotError;

/// Why a handshake or a page server failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// A system call failed.
    #[error("{op}: {source}")]
    Io {
        /// What was done.
        op: &'static str,
        /// The errno.
        source: io::Error,
    },
    /// The peer's handshake is not what Firecracker sends.
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// A memory file cannot serve the regions, or changed while served.
    #[error("memory file {}: {problem}", path.display())]
    MemoryFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: MemoryFileProblem,
    },
    /// A VM taken back after a restart was served a memory file that none of this server's
    /// sockets serves now.
    #[error(
        "the memory file served to peer {pid} is not among those served now (device, inode, \
         size and modification time): it was replaced or truncated, or is not given"
    )]
    Unmatched {
        /// The VM's process id.
        pid: i32,
    },
    /// A working-set file does not parse, or cannot be written where asked.
    #[error("working set {}: {problem}", path.display())]
    WorkingSet {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: WorkingSetProblem,
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
    /// A socket path cannot be listened on, or cannot be used at all.
    #[error("socket {}: {refusal}", path.display())]
    SocketPath {
        /// The path.
        path: PathBuf,
        /// Why not.
        refusal: SocketRefusal,
    },
    /// The state directory cannot be used.
    #[error("state directory {}: {problem}", path.display())]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// Why not.
        problem: StateDirProblem,
    },
    /// A VM's session record cannot be made, written or used.
    #[error("session record of peer {}: {problem}", pid.map_or("?".into(), |p| p.to_string()))]
    Record {
        /// The VM's process id, when known.
        pid: Option<i32>,
        /// What went wrong.
        problem: RecordProblem,
    },
    /// A VM's userfaultfd could not be taken back from it after a restart.
    #[error("take back the userfaultfd {fd} of peer {pid}: {source}")]
    TakeBack {
        /// The VM's process id.
        pid: i32,
        /// The descriptor's number in the VM.
        fd: i32,
        /// The errno.
        source: io::Error,
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
    /// A VM could not be handed to the server taking over.
    #[error("hand the VM to the new server: {0}")]
    HandOff(#[source] io::Error),
    /// Serving failed: the first error, naming the region, address and file offset.
    #[error("serving the peer's memory: {0}")]
    Serve(#[source] Box<SnapshotError>),
    /// An error kept in a report (a session that ended with it) and given again.
    #[error("{0}")]
    Reported(Arc<ServeError>),
}

/// What is wrong with a memory file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryFileProblem {
    /// It cannot be opened or read as a regular file.
    #[error("cannot {op} it: {source}")]
    Open {
        /// What was done.
        op: &'static str,
        /// The errno, or what is wrong with it.
        source: io::Error,
    },
    /// It is shorter than a region needs.
    #[error(
        "holds {len:#x} bytes, but region {region} (peer host address {host:#x}, {size:#x} \
         bytes) needs offsets {offset:#x}..{:#x}", offset + size
    )]
    TooShort {
        /// Its length.
        len: u64,
        /// The region's index in the handshake.
        region: usize,
        /// The region's address in the peer.
        host: u64,
        /// Its size.
        size: u64,
        /// Where it starts in the file.
        offset: u64,
    },
    /// Its regions do not make an image.
    #[error("{0}")]
    Image(#[source] Box<SnapshotError>),
    /// It changed while served (written in place, truncated or touched): serving it on
    /// would mix two files.
    #[error(
        "changed while served (written in place, truncated or touched): its VMs are ended and \
         its socket closed; start a server again to serve the file as it is now"
    )]
    Changed,
}

/// What is wrong with a working-set file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkingSetProblem {
    /// It cannot be read (or its directory used).
    #[error("cannot {op} it: {source}")]
    Io {
        /// What was done.
        op: &'static str,
        /// The errno, or what is wrong with it.
        source: io::Error,
    },
    /// It is not JSON of the format.
    #[error("{0}")]
    Parse(#[source] serde_json::Error),
    /// Its `format` is another's.
    #[error("format {0:?}, expected \"guestmem-working-set\"")]
    Format(String),
}

/// Why a state directory cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateDirProblem {
    /// It cannot be made, opened or read.
    #[error("cannot {op} it: {source}")]
    Io {
        /// What was done.
        op: &'static str,
        /// The errno.
        source: io::Error,
    },
    /// Someone else could write records into it (which make the server take descriptors
    /// from processes and end those it cannot serve).
    #[error(
        "owned by uid {uid} with mode {mode:o}; it must be this user's ({euid}) and writable \
         by no one else"
    )]
    NotPrivate {
        /// Its owner.
        uid: u32,
        /// Its mode.
        mode: u32,
        /// This process's effective uid.
        euid: u32,
    },
    /// Another server holds it (two servers would serve the same VMs).
    #[error("another server holds it (two servers would serve the same VMs)")]
    Held,
}

/// Why a session record cannot be made, written or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordProblem {
    /// The VM's pid is not known (`SO_PEERCRED` gave none).
    #[error("no pid for the VM")]
    NoPid,
    /// `/proc` does not say when the VM started (it exited).
    #[error("no start time in /proc (the VM exited)")]
    NoStartTime,
    /// The VM's number for its userfaultfd could not be found.
    #[error("its userfaultfd's number in the VM: {0}")]
    UffdNumber(#[source] io::Error),
    /// The memory file's identity could not be read.
    #[error("the memory file's identity: {0}")]
    MemoryFile(#[source] io::Error),
    /// It could not be written, read or parsed.
    #[error("{op}: {source}")]
    Io {
        /// What was done.
        op: &'static str,
        /// The errno, or what is wrong with it.
        source: io::Error,
    },
    /// Its `format` is another's.
    #[error("format {0:?}, expected \"guestmem-session\"")]
    Format(String),
}

impl ServeError {
    /// A failed system call.
    pub(crate) fn io(op: &'static str) -> impl FnOnce(io::Error) -> ServeError {
        move |source| ServeError::Io { op, source }
    }
}
