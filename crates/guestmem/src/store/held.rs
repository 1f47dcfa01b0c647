//! A move's frames held where they lie: each frame of the diff kept as the runs of the diff
//! file it was read from, read again (and framed) only when the destination asks for it.
//! Cutting a diff in the pause so costs a read and a hash a frame, and no memory of its size:
//! on a host whose fresh pages cost microseconds each to fault in, 64 MiB of new objects
//! took 50 ms, most of the pause's frames step. The destination checks every frame against
//! its hash, so a file changed underneath fails closed there, never served as memory.

use std::collections::HashMap;
use std::fs::File;
use std::sync::{OnceLock, RwLock};

use bytes::Bytes;

use super::source::read_runs;
use super::StoreError;

/// One frame held.
#[derive(Debug)]
enum Held {
    /// Its plain bytes are these runs (offset, bytes) of the file, one after another.
    Runs {
        plain_len: u64,
        runs: Vec<(u64, u64)>,
    },
    /// Its object, made when it was cut (a frame that is not a run of the file).
    Object(Bytes),
    /// A piece of a diff named later (under a placeholder, [`super::later`]): these runs of
    /// the file, served as the hash of their bytes (hashed when asked) and their object.
    Later {
        plain_len: u64,
        runs: Vec<(u64, u64)>,
    },
}

/// The frames of one diff, served by [`super::PeerServer`] under their store keys.
#[derive(Debug, Default)]
pub struct HeldFrames {
    /// The diff file and its length, once a push attaches it.
    file: OnceLock<(File, u64)>,
    frames: RwLock<HashMap<[u8; 32], Held>>,
}

impl HeldFrames {
    /// None yet.
    pub fn new() -> HeldFrames {
        HeldFrames::default()
    }

    /// Frames held.
    pub fn len(&self) -> usize {
        self.frames.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The file the runs are read from; a second file is refused (one diff a holder).
    pub(super) fn attach(&self, file: File, len: u64) -> Result<(), StoreError> {
        self.file.set((file, len)).map_err(|_| StoreError::Limit {
            what: "diff files held by one HeldFrames (one diff a move)",
            value: 2,
            limit: 1,
        })
    }

    /// Holds the frame of `hash` as `runs` of the attached file.
    pub(super) fn hold_runs(&self, hash: &blake3::Hash, runs: Vec<(u64, u64)>) {
        let plain_len = runs.iter().map(|r| r.1).sum();
        self.frames
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(*hash.as_bytes(), Held::Runs { plain_len, runs });
    }

    /// Holds the piece of placeholder `name` as `runs` of the attached file.
    pub(super) fn hold_later(&self, name: &blake3::Hash, runs: Vec<(u64, u64)>) {
        let plain_len = runs.iter().map(|r| r.1).sum();
        self.frames
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(*name.as_bytes(), Held::Later { plain_len, runs });
    }

    /// Holds the frame of `hash` as its object.
    pub(super) fn hold_object(&self, hash: &blake3::Hash, object: Bytes) {
        self.frames
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(*hash.as_bytes(), Held::Object(object));
    }

    /// The length of the object of the frame under `hex` (its hash), without reading it;
    /// `sealed`: a piece named later is served with its seal.
    pub(super) fn object_len(&self, hex: &str, sealed: bool) -> Option<u64> {
        let hash = blake3::Hash::from_hex(hex).ok()?;
        let frames = self.frames.read().unwrap_or_else(|e| e.into_inner());
        match frames.get(hash.as_bytes())? {
            Held::Object(b) => Some(b.len() as u64),
            Held::Runs { plain_len, .. } => Some(plain_len + super::frame::HEADER_BYTES as u64),
            Held::Later { plain_len, .. } => Some(
                plain_len
                    + (super::frame::HEADER_BYTES + super::frame::named_prefix(sealed)) as u64,
            ),
        }
    }

    /// The object of the frame under `hex` (its hash), raw, read from the file now; for a
    /// piece named later (`hex` its placeholder), the hash of its bytes first.
    /// `seal`: a move's key, with which a piece named later is sealed ([`super::frame::seal`]).
    pub(super) fn object(
        &self,
        hex: &str,
        seal: Option<&[u8; 32]>,
    ) -> Result<Option<Bytes>, StoreError> {
        let Ok(hash) = blake3::Hash::from_hex(hex) else {
            return Ok(None);
        };
        let (named, plain_len, runs) = {
            let frames = self.frames.read().unwrap_or_else(|e| e.into_inner());
            match frames.get(hash.as_bytes()) {
                None => return Ok(None),
                Some(Held::Object(b)) => return Ok(Some(b.clone())),
                Some(Held::Runs { plain_len, runs }) => (false, *plain_len, runs.clone()),
                Some(Held::Later { plain_len, runs }) => (true, *plain_len, runs.clone()),
            }
        };
        let Some((file, len)) = self.file.get() else {
            return Ok(None);
        };
        let obj = super::frame::raw_for(plain_len as usize);
        let at = match named {
            false => 0,
            true => super::frame::named_prefix(seal.is_some()),
        };
        let mut out = Vec::with_capacity(at + obj.capacity());
        out.resize(at, 0);
        out.extend_from_slice(&obj);
        read_runs(file, *len, &runs, &mut out)?;
        if named {
            let h = blake3::hash(&out[at + super::frame::HEADER_BYTES..]);
            out[..super::frame::NAMED_PREFIX_BYTES].copy_from_slice(h.as_bytes());
            if let Some(key) = seal {
                out[super::frame::NAMED_PREFIX_BYTES..at]
                    .copy_from_slice(&super::frame::seal(key, &hash, &h));
            }
        }
        Ok(Some(Bytes::from(out)))
    }
}
