//! Snapshots in object storage: pushed once, served to any VM on any host straight from S3,
//! each frame fetched once per host.
//!
//! # The format
//! A snapshot's memory is cut into fixed frames (1 MiB unless told: the page server's block,
//! so that one fault is one GET). Each frame is stored once, under the BLAKE3 hash of its
//! bytes (`frames/<hash>`), zstd-compressed where that saves an eighth, raw where it does
//! not; frames of zeros are stored nowhere. A snapshot is one small manifest
//! (`snapshots/NAME/manifest.json`) naming its frames in order, written last: a snapshot in
//! the bucket is whole or absent. A diff stores only the pages it wrote (a frame's piece of
//! those pages, with their mask), and names its base's frames for the rest; frames are
//! shared by every snapshot that holds the same bytes.
//!
//! # Serving
//! [`StoreMemory`] is a snapshot opened for serving: its manifest read and checked once, its
//! frames fetched through the host's [`Frames`] as the VM faults: from the node-local
//! [`FrameCache`] when there (checked against its hash on every read), else one GET however
//! many VMs wait on it, checked, retried with backoff until a deadline. Read-ahead and the
//! working set are fetched many at once, in the background, below the faults.
//!
//! # Trust
//! Nothing read from the bucket is used unchecked: manifests are parsed with limits, and
//! every frame's bytes must hash to its name. Credentials are held by [`Client`] alone and
//! redacted from every error.

mod cache;
mod client;
mod cut;
mod diff_file;
mod direct;
mod error;
mod fetch;
mod frame;
mod gc;
mod held;
mod later;
mod lease;
mod manifest;
mod memory;
mod peer;
mod profile;
mod pull;
mod push;
mod source;
mod url;

pub use cache::{CacheCounters, FrameCache, MAX_CACHE_BYTES};
pub use client::{Client, Listed};
pub use diff_file::check_diff_folder;
pub(crate) use diff_file::diff_folder_problem;
pub use error::StoreError;
pub use fetch::{FetchCounters, FetchPolicy, Frames, StoreStatus};
pub(crate) use frame::same_bytes;
pub use gc::{gc, list, GcReport, Listing};
pub use held::HeldFrames;
pub(crate) use later::later_names;
pub use later::{name_later, NamedLater};
pub use lease::{check_push, LEASE_STALE};
pub use manifest::{
    check_frame_bytes, PieceRef, Snapshot, StoreManifest, DEFAULT_FRAME_BYTES, MAX_FRAME_BYTES,
    MAX_MANIFEST_BYTES, MAX_PIECES, MIN_FRAME_BYTES,
};
pub use memory::{read_snapshot, StoreMemory};
#[cfg(test)]
pub(crate) use peer::held_tests;
pub use peer::{PeerCounters, PeerServer};
pub use pull::{pull, PullReport};
pub use push::{push, push_held, PushConfig, PushReport, PushSource};
pub use url::StoreUrl;
