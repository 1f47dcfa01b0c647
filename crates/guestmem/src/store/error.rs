//! What can go wrong with a snapshot in object storage, each error naming the URL, the object
//! or the limit at fault. No error carries a credential: a client error's text is redacted
//! (`Client::redact`) before it is kept.

use std::path::PathBuf;
use std::time::Duration;

/// An error of [`crate::store`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The URL is not `s3://BUCKET/NAME`.
    #[error("{url}: {reason} (expected s3://BUCKET/NAME)")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The client could not be set up (endpoint, region, credentials).
    #[error("object store for bucket {bucket}: {reason}")]
    Config {
        /// The bucket.
        bucket: String,
        /// Why, redacted.
        reason: String,
    },
    /// A request failed (after its retries, where it has any).
    #[error("{op} {url}: {reason}")]
    Request {
        /// What was asked.
        op: &'static str,
        /// The object or prefix, as `s3://bucket/key`.
        url: String,
        /// The client's error, redacted.
        reason: String,
        /// The store answered that the object, the bucket, or our access to it, is not
        /// there: asking again will not help.
        permanent: bool,
    },
    /// No snapshot of that name in the bucket.
    #[error("{url}: no such snapshot (its manifest {key} is not in the bucket)")]
    NoSnapshot {
        /// The snapshot's URL.
        url: String,
        /// The manifest's key.
        key: String,
    },
    /// A snapshot of that name is there already: a push never replaces one.
    #[error("{url}: a snapshot of that name is in the bucket already; push under a new name (or delete it first)")]
    Exists {
        /// The snapshot's URL.
        url: String,
    },
    /// A manifest that fails its checks.
    #[error("manifest {url}: {reason}")]
    Manifest {
        /// Where it was read.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// A frame whose bytes are not what its name says, read twice.
    #[error("frame {url}: {reason}")]
    Frame {
        /// Where it was read.
        url: String,
        /// What is wrong (its header, its length, its hash).
        reason: String,
    },
    /// A fetch that did not succeed within its deadline.
    #[error("frame {url}: not fetched within the deadline of {deadline:?} ({attempts} attempts; last: {last})")]
    Deadline {
        /// The frame.
        url: String,
        /// The deadline.
        deadline: Duration,
        /// Requests made.
        attempts: u32,
        /// The last attempt's error.
        last: String,
    },
    /// A file of this host.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The kernel's error.
        source: std::io::Error,
    },
    /// The source of a push could not be read.
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    /// A diff whose base does not fit it.
    #[error("base {url}: {reason}")]
    Base {
        /// The base's URL.
        url: String,
        /// Why it does not fit.
        reason: String,
    },
    /// Asked to stop by its caller (a push or a gc): nothing published, its lease or mark
    /// in the bucket given back.
    #[error("{op} {url}: asked to stop; nothing published, its lease given back")]
    Stopped {
        /// What was stopped.
        op: &'static str,
        /// The snapshot or bucket.
        url: String,
    },
    /// A limit of the format or of this host.
    #[error("{what}: {value} is past the limit of {limit}")]
    Limit {
        /// What is limited.
        what: &'static str,
        /// The value found.
        value: u64,
        /// The limit.
        limit: u64,
    },
}

impl StoreError {
    /// Whether asking again may help (a request that failed for a reason other than the
    /// object, the bucket or our access not being there).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Request {
                permanent: false,
                ..
            }
        )
    }
}
