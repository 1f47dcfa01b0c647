//! The error every scenario returns: one enum, each variant naming what failed and where.

use std::io;
use std::path::PathBuf;

use guestmem::inspect::InspectError;
use guestmem::{BringupError, MapError, PopulateError};

use crate::peer::PeerError;

/// Why a lab scenario failed.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// The configuration cannot be run as given.
    #[error("{scenario}: {reason}")]
    Config {
        /// The scenario.
        scenario: &'static str,
        /// What is wrong with the configuration.
        reason: String,
    },
    /// guestmem could not map a layout.
    #[error("guestmem map: {0}")]
    Map(#[from] MapError),
    /// guestmem could not populate a map.
    #[error("guestmem populate: {0}")]
    Populate(#[from] PopulateError),
    /// guestmem could not bring a map up.
    #[error("guestmem bringup: {0}")]
    Bringup(#[from] BringupError),
    /// A peer's way of mapping failed.
    #[error(transparent)]
    Peer(#[from] PeerError),
    /// smaps could not be read.
    #[error(transparent)]
    Inspect(#[from] InspectError),
    /// A procfs file the scenario reads could not be read.
    #[error("{scenario}: reading {what}: {source}")]
    Read {
        /// The scenario.
        scenario: &'static str,
        /// The file.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
    /// A worker thread could not be created.
    #[error("{scenario}: creating a worker thread: {source}")]
    Spawn {
        /// The scenario.
        scenario: &'static str,
        /// The error.
        source: io::Error,
    },
    /// A snapshot, restore or page-server step of the restore scenario failed.
    #[error("restore: {0}")]
    Restore(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// vm-memory refused the regions (its error types differ per call, so it is kept as text).
    #[error("vm-memory: {0}")]
    VmMemory(String),
    /// The run folder or a result file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The plot could not be drawn.
    #[error("plotting {path}: {reason}")]
    Plot {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

impl LabError {
    /// A restore scenario's failure: the library's error (kept as the source), or what the
    /// scenario found wrong.
    pub fn restore(what: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> LabError {
        LabError::Restore(what.into())
    }
}
