//! The destination's chain: the manifest the source sent, checked against the base this
//! host read itself, the pieces the source owes named (or named later), and the page server
//! started on it, its prefetch held until the VM runs.

use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::owed::owed;
use super::{MoveError, OnDrop};
use crate::serve::{
    Drainer, Listener, MemoryFile, PrefetchHold, ServeError, Server, ServerConfig, ServerReport,
    Socket,
};
use crate::store::{Client, Frames, Snapshot, StoreError, StoreMemory, StoreUrl};

/// What the chain is served from.
pub(super) struct Chain<'a> {
    /// The chain's manifest, as the source sent it.
    pub(super) manifest: &'a [u8],
    /// Its pieces owed by the source are named by placeholders until the store names them.
    pub(super) later: bool,
    /// The move's name in the store.
    pub(super) name_url: &'a StoreUrl,
    /// The base, as this host read it.
    pub(super) base: &'a Snapshot,
    pub(super) frames: &'a Arc<Frames>,
    /// The placeholders to forget when the move ends.
    pub(super) forget: &'a Mutex<Vec<blake3::Hash>>,
    /// The source's frames.
    pub(super) peer: &'a Arc<Client>,
    /// The page server's socket, bound before the pause.
    pub(super) listener: Listener,
    pub(super) server: ServerConfig,
    /// Signalled once the page server returns (its VM no longer served).
    pub(super) served: &'a Arc<OwnedFd>,
    /// The socket's path, for errors.
    pub(super) sock: &'a Path,
}

/// The chain being served.
pub(super) struct Serving {
    pub(super) chain: Snapshot,
    /// Frames of which the source owes a piece.
    pub(super) owed_frames: u64,
    /// The owed pieces to read ahead, with their plain lengths.
    pub(super) ahead: Vec<(blake3::Hash, usize)>,
    pub(super) drainer: Drainer,
    /// The page server's thread.
    pub(super) run: JoinHandle<Result<ServerReport, ServeError>>,
    /// The placeholders the owed pieces are named by (empty unless named later).
    pub(super) placeholders: HashSet<[u8; 32]>,
    /// The VM's prefetch, held until it runs.
    pub(super) hold: PrefetchHold,
}

/// Checks the chain and starts serving it.
pub(super) fn serve_chain(c: Chain<'_>) -> Result<Serving, MoveError> {
    let chain = Snapshot::parse(c.name_url, c.manifest)?;
    let owed = owed(c.base, &chain)?;
    // Named later: every piece the source owes is under a placeholder until the
    // store's manifest names it.
    let placeholders: HashSet<[u8; 32]> = match c.later {
        false => HashSet::new(),
        true => owed.iter().map(|&(_, h)| *h.as_bytes()).collect(),
    };
    if c.later && placeholders.len() != owed.len() {
        return Err(MoveError::Store(StoreError::Manifest {
            url: chain.url.to_string(),
            reason: format!(
                "{} pieces named later under {} placeholders: one names two pieces",
                owed.len(),
                placeholders.len()
            ),
        }));
    }
    c.frames
        .name_later(owed.iter().filter(|_| c.later).map(|&(_, h)| h));
    *c.forget.lock().unwrap_or_else(|e| e.into_inner()) =
        owed.iter().filter(|_| c.later).map(|&(_, h)| h).collect();
    let fb = chain.frame_bytes();
    // With a cache, the owed frames are read ahead into it once the VM runs:
    // until then only faults ask the source, so that Firecracker's load (which
    // touches a few pages) and the resume never wait behind read-ahead. Without
    // one, they are the VM's working set: asked for at once when the VM connects
    // (during the load: not held back), and installed by the prefetch once it
    // runs.
    let working_set: Vec<u64> = match c.frames.cache() {
        Some(_) => Vec::new(),
        None => owed.iter().map(|&(i, _)| i * fb).collect(),
    };
    let ahead: Vec<(blake3::Hash, usize)> = owed
        .iter()
        .map(|&(i, h)| {
            let len = fb.min(chain.memory_bytes() - i * fb);
            let piece = chain.frames[i as usize].iter().find(|p| p.hash == h);
            (h, piece.map_or(len, |p| p.plain_len(len)) as usize)
        })
        .collect();
    c.frames
        .follow(Arc::clone(c.peer), owed.iter().map(|&(_, h)| h));
    let memory = MemoryFile::from_store(StoreMemory::from_snapshot(
        Arc::clone(c.frames),
        chain.clone(),
    ));
    let server = Server::new(
        vec![Socket {
            listener: c.listener,
            memory,
            working_set,
        }],
        c.server,
    )?;
    let drainer = server.drainer();
    // Firecracker's load and the resume, the move's pause, do not share this
    // host's CPUs with the VM's prefetch: it starts once the VM runs.
    let hold = server.hold_prefetch();
    let served = Arc::clone(c.served);
    let run = std::thread::Builder::new()
        .name("guestmem-move-in".into())
        .spawn(move || {
            // The VM is no longer served (the server returned, or panicked):
            // the wait for the push ends.
            let _signal = OnDrop(|| {
                let _ = crate::sys::eventfd_signal(served.as_fd());
            });
            server.run()
        })
        .map_err(|source| MoveError::Io {
            op: "start the page server for",
            path: c.sock.to_path_buf(),
            source,
        })?;
    Ok(Serving {
        chain,
        owed_frames: owed.len() as u64,
        ahead,
        drainer,
        run,
        placeholders,
        hold,
    })
}
