//! The destination host's side of a move: check the base, take the chain and the vmstate,
//! serve the chain (the diff's frames followed from the source), load and resume the VM,
//! and stop needing the source once the store holds the diff.

use std::net::TcpListener;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::firecracker::{json_path, Api};
use super::owed::{look_in_store, released, STORE_LOOK_LIMIT};
use super::wire::{Msg, Wire, WIRE_VERSION};
use super::{MoveError, OnDrop, OnPanic};
use crate::restore::latency::{ExactLatency, LatencySummary};
use crate::serve::{Listener, ServerConfig, ServerReport};
use crate::store::{read_snapshot, Client, Frames, StoreError, StoreUrl};

/// How long Firecracker's `snapshot/load` (and resume) may take here.
pub(super) const LOAD_LIMIT: Duration = Duration::from_secs(120);
/// How long the destination Firecracker may take to exit once sent SIGKILL (a process
/// exits once its threads have left the kernel: a guest's memory freed, milliseconds to
/// seconds).
const END_LIMIT: Duration = Duration::from_secs(10);
/// How long the vmstate's bytes may take to arrive after their announcement.
const PAYLOAD_LIMIT: Duration = Duration::from_secs(20);

/// A move into this host.
#[derive(Debug, Clone)]
pub struct MoveIn {
    /// The destination Firecracker's API socket (a process started, nothing loaded).
    pub api: PathBuf,
    /// Where the vmstate and the page server's socket go (the vmstate is removed when the
    /// move ends).
    pub dir: PathBuf,
    /// How the VM is served (one VM: `Vms::One`). With `prefetch_threads` 0 nothing is
    /// fetched ahead, the source's frames included: each comes to the VM through a fault
    /// (what a remote fault costs shows alone; until the store holds the diff, more of it
    /// is on the source alone).
    pub server: ServerConfig,
    /// How long to wait for the source: its connection, and each message.
    pub wait: Duration,
    /// The move key both hosts hold (`None`: the move is not authenticated; the source
    /// must have none either). See [`super::MoveKey`].
    pub key: Option<super::MoveKey>,
    /// Readable once the move is to stop (an eventfd a signal's watcher writes, say):
    /// before the VM runs here the move is refused and this side's copy ended (the source
    /// resumes its own), at once while it waits on the source or on Firecracker's load,
    /// after the step under way otherwise (reading the base's manifest: at most the fetch
    /// deadline); once it runs,
    /// the server drains: the rest of its memory is brought in, and the VM runs on without
    /// it. `None`: never.
    pub stop: Option<Arc<std::os::fd::OwnedFd>>,
}

/// What a move into this host did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MoveInReport {
    /// The snapshot the VM came from (its base) and the move's name.
    pub base: String,
    /// The move's name.
    pub name: String,
    /// Frames the source owed.
    pub owed_frames: u64,
    /// Milliseconds from the chain received to it served here.
    pub open_ms: f64,
    /// Milliseconds of Firecracker's `snapshot/load`, from the vmstate received (it runs
    /// while the source cuts its diff into frames).
    pub load_ms: f64,
    /// Milliseconds from the VM running to the source no longer needed (`None`: it was
    /// still needed when the VM ended, or the source went away).
    pub released_ms: Option<f64>,
    /// GETs of frames sent to the source, and their bytes.
    pub peer_gets: u64,
    /// See `peer_gets`.
    pub peer_bytes: u64,
    /// Latency of those GETs.
    pub peer_latency: LatencySummary,
    /// Latency of those a fault sent itself (not read-ahead, nor a prefetch thread).
    pub peer_fault_latency: LatencySummary,
    /// How long faults waited for frames the source owed and this host did not hold yet
    /// (their own GET, or one in flight they joined): remote faults, but for the install.
    pub peer_fault_wait: LatencySummary,
    /// The same waits' quantiles as measured (the histogram's bucket is up to 19% wide).
    pub peer_fault_wait_exact: ExactLatency,
    /// The page server's report, when the VM ended.
    #[serde(skip)]
    pub server: Option<ServerReport>,
}

/// Takes one move on `listener`: waits (at most `m.wait`) for a source, then serves the VM
/// it moves here until the VM ends. `frames_for` gives the frames of a bucket (the host's
/// cache shared): one `Frames` for this move, as it follows the source for the diff's.
pub fn move_in(
    listener: &TcpListener,
    m: &MoveIn,
    frames_for: &mut dyn FnMut(&StoreUrl) -> Result<Arc<Frames>, StoreError>,
) -> Result<MoveInReport, MoveError> {
    // Readable once the page server has returned (its VM no longer served).
    let served_fd = Arc::new(crate::sys::eventfd().map_err(|source| MoveError::Io {
        op: "make an eventfd for",
        path: m.dir.clone(),
        source,
    })?);
    let stop = m.stop.as_ref().map(|f| f.as_fd());
    let stopped = || stop.is_some_and(crate::sys::is_readable);
    let asked_to_stop = || MoveError::Refused {
        side: "destination",
        reason: "asked to stop before the VM ran here; nothing moved".into(),
    };
    let (mut wire, token, offer) =
        super::offer::first_offer(listener, m.wait, m.key.as_ref(), stop)?;
    let (base_url, peer_url, name) = match offer {
        Msg::Offer {
            version,
            base,
            peer,
            name,
        } if version == WIRE_VERSION => (base, peer, name),
        Msg::Offer { version, .. } => {
            let e = MoveError::Wire {
                peer: wire.peer().into(),
                reason: format!(
                    "the source speaks move messages v{version}, this host v{WIRE_VERSION}"
                ),
            };
            return Err(wire.refuse(e));
        }
        other => {
            return Err(MoveError::Wire {
                peer: wire.peer().into(),
                reason: format!("expected an offer, got {other:?}"),
            })
        }
    };
    // Refused before anything is paused: a base this host cannot read, a bad name.
    let checked = (|| -> Result<_, MoveError> {
        let base_url = StoreUrl::parse(&base_url, false)?;
        let name_url = StoreUrl::parse(&format!("s3://{}/{name}", base_url.bucket), false)?;
        let frames = frames_for(&base_url)?;
        let base = read_snapshot(&frames, &base_url)?;
        let peer = Arc::new(match &token {
            Some((t, seal)) => Client::peer_locked(&peer_url, t, *seal)?,
            None => Client::peer(&peer_url)?,
        });
        // The source's frames answer here (nothing is there yet: a 404 is an answer).
        peer.get(&name_url.manifest_key())
            .map_err(|e| MoveError::Refused {
                side: "destination",
                reason: format!("the source's frames at {peer_url} do not answer: {e}"),
            })?;
        let (api, process) = Api::open(&m.api, "destination")?;
        // This host's files, made before anything is paused: a name too long for a file
        // here, or a folder that cannot take them, refuses the move now, not in the pause.
        // The name may hold '/' (never a '..' part): one file name of it here.
        let vmstate = m
            .dir
            .join(format!("{}.vmstate", name_url.name.replace('/', "_")));
        let state_file = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&vmstate)
                .map_err(|source| MoveError::Io {
                    op: "write (a new file)",
                    path: vmstate.clone(),
                    source,
                })?
        };
        // Ours from here (a file that was there already is another move's: left alone).
        let removed = RemovedOnDrop(vmstate.clone());
        // Named by this process and a count, not by the move: a socket's path is at most
        // 107 bytes.
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let sock = m.dir.join(format!(
            "uffd-{}-{}.sock",
            std::process::id(),
            SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let listener = Listener::bind(&sock)?;
        Ok((
            base_url,
            name_url,
            frames,
            base,
            peer,
            api,
            process,
            (vmstate, state_file, removed, sock, listener),
        ))
    })();
    let (base_url, name_url, frames, base, peer, api, process, local) = match checked {
        Ok(_) if stopped() => return Err(wire.refuse(asked_to_stop())),
        Ok(v) => v,
        Err(e) => return Err(wire.refuse(e)),
    };
    wire.send(
        &Msg::Ready {
            version: WIRE_VERSION,
        },
        &[],
    )?;
    let Some(said) = wire.recv_unless(m.wait, stop)? else {
        return Err(wire.refuse(asked_to_stop()));
    };
    let vmstate_bytes = match said {
        Msg::State { vmstate_bytes } => vmstate_bytes,
        Msg::Abort { reason } => {
            return Err(MoveError::Refused {
                side: "source",
                reason,
            })
        }
        other => {
            return Err(MoveError::Wire {
                peer: wire.peer().into(),
                reason: format!("expected the vmstate, got {other:?}"),
            })
        }
    };
    let state = wire.payload("vmstate", vmstate_bytes, PAYLOAD_LIMIT)?;
    let t_load = Instant::now();
    let (vmstate, mut state_file, _vmstate_removed, sock, listener) = local;
    let written = {
        use std::io::Write;
        state_file
            .write_all(&state)
            .map_err(|source| MoveError::Io {
                op: "write",
                path: vmstate.clone(),
                source,
            })
    };
    drop(state_file);
    if let Err(e) = written {
        return Err(wire.refuse(e));
    }
    // Firecracker loads the VM (paused) while the source cuts its diff into frames. Its
    // connection to the page server's socket waits in the listen backlog, and is taken once
    // the chain is here; a touch of memory before that waits for it (a userfault).
    let load_body = format!(
        r#"{{"snapshot_path":{},"mem_backend":{{"backend_type":"Uffd","backend_path":{}}},"track_dirty_pages":true,"resume_vm":false}}"#,
        json_path(&vmstate),
        json_path(&sock)
    );
    // A panic from here until the VM runs here ends this copy on its way out (it never
    // ran; the source resumes its own when the connection drops).
    // The placeholders of a chain named later are forgotten when the move ends, however.
    let forget = ForgetLater(std::sync::Mutex::new(Vec::new()), &frames);
    let end_on_panic = OnPanic(|| {
        tracing::error!("move-in panicked before the VM ran here; ending its copy");
        let _ = process.kill();
    });
    // Readable once Firecracker's load has answered, so that a stop is seen while it runs.
    let load_done = crate::sys::eventfd().map_err(|source| MoveError::Io {
        op: "make an eventfd for",
        path: m.dir.clone(),
        source,
    });
    let load_done = match load_done {
        Ok(fd) => fd,
        Err(e) => return Err(wire.refuse(e)),
    };
    let (opened, loaded, load_ms, open_ms, killed) = std::thread::scope(|scope| {
        let load = scope.spawn(|| {
            let _done = OnDrop(|| {
                let _ = crate::sys::eventfd_signal(load_done.as_fd());
            });
            let r = api.ok("PUT", "snapshot/load", &load_body, LOAD_LIMIT);
            (r, t_load.elapsed().as_secs_f64() * 1e3)
        });
        // The chain: checked as any manifest, then against the base this host read itself.
        let mut t_open = Instant::now();
        let opened = wire
            .recv_unless(LOAD_LIMIT, stop)
            .and_then(|msg| msg.ok_or_else(asked_to_stop))
            .and_then(|msg| match msg {
                Msg::Diff {
                    manifest_bytes,
                    later,
                } => {
                    let manifest = wire.payload("manifest", manifest_bytes, PAYLOAD_LIMIT);
                    t_open = Instant::now();
                    manifest.map(|m| (m, later))
                }
                Msg::Abort { reason } => Err(MoveError::Refused {
                    side: "source",
                    reason,
                }),
                other => Err(MoveError::Wire {
                    peer: wire.peer().into(),
                    reason: format!("expected the chain, got {other:?}"),
                }),
            })
            .and_then(|(manifest, later)| {
                super::chain::serve_chain(super::chain::Chain {
                    manifest: &manifest,
                    later,
                    name_url: &name_url,
                    base: &base,
                    frames: &frames,
                    forget: &forget.0,
                    peer: &peer,
                    listener,
                    server: m.server.clone(),
                    served: &served_fd,
                    sock: &sock,
                })
            });
        let open_ms = t_open.elapsed().as_secs_f64() * 1e3;
        // Asked to stop while Firecracker loads (its load bounded only by LOAD_LIMIT): this
        // copy is ended, which ends its load, and the move refused.
        let stopped_in_load = opened.is_ok()
            && stop.is_some_and(|stop| {
                let mut fds = [
                    crate::sys::PollFd::readable(load_done.as_fd()),
                    crate::sys::PollFd::readable(stop),
                ];
                // No limit: the load's own requests end within LOAD_LIMIT.
                matches!(crate::sys::poll(&mut fds, None), Ok(n) if n > 0 && fds[1].ready() && !fds[0].ready())
            });
        if opened.is_err() || stopped_in_load {
            // Nothing serves this copy, or it is not to run: it is ended (it never ran),
            // which ends its load.
            if let Err(k) = process.kill() {
                tracing::error!("ending the destination Firecracker failed: {k}");
            }
        }
        let (loaded, load_ms) = load.join().unwrap_or_else(|_| {
            (
                Err(MoveError::Wire {
                    peer: wire.peer().into(),
                    reason: "the load's thread panicked".into(),
                }),
                0.0,
            )
        });
        let loaded = match stopped_in_load {
            true => Err(MoveError::Refused {
                side: "destination",
                reason: "asked to stop during Firecracker's load, before the VM ran here; its \
                         copy ended, nothing moved"
                    .into(),
            }),
            false => loaded,
        };
        (opened, loaded, load_ms, open_ms, stopped_in_load)
    });
    let super::chain::Serving {
        chain,
        owed_frames,
        ahead,
        drainer,
        run,
        placeholders,
        hold,
    } = match opened {
        Ok(v) => v,
        Err(e) => return Err(wire.refuse(e)),
    };
    // Ends this side's copy (it never ran) and its server, and says why.
    let abandon = |wire: &mut Wire, e: MoveError| {
        // (Ended already where it was stopped in its load.)
        if !killed {
            if let Err(k) = process.kill() {
                tracing::error!("ending the destination Firecracker failed: {k}");
            }
        }
        let e = wire.refuse(e);
        drainer.drain();
        e
    };
    if let Err(e) = loaded {
        let e = abandon(&mut wire, e);
        let _ = run.join();
        return Err(e);
    }
    if let Err(e) = wire.send(&Msg::Loaded { load_ms, open_ms }, &[]) {
        // The source resumes its copy: this one, loaded and never run, ends.
        let e = abandon(&mut wire, e);
        let _ = run.join();
        return Err(e);
    }
    let said = match wire.recv_unless(LOAD_LIMIT, stop) {
        Ok(None) => {
            let e = abandon(&mut wire, asked_to_stop());
            let _ = run.join();
            return Err(e);
        }
        Ok(Some(m)) => Ok(m),
        Err(e) => Err(e),
    };
    let go = match said {
        Ok(Msg::Commit) => api.ok("PATCH", "vm", r#"{"state":"Resumed"}"#, LOAD_LIMIT),
        Ok(Msg::Abort { reason }) => Err(MoveError::Refused {
            side: "source",
            reason,
        }),
        Ok(other) => Err(MoveError::Wire {
            peer: wire.peer().into(),
            reason: format!("expected Commit, got {other:?}"),
        }),
        Err(e) => Err(e),
    };
    if let Err(e) = go {
        // After a Commit its resume may have taken hold though it failed: the source is
        // told to resume its copy only once this one is surely ended (else it stays
        // paused: never two copies running).
        // Surely: seen to have exited (its pidfd readable), not only sent SIGKILL, so
        // that no thread of it runs on while the source's copy resumes.
        let ended = process
            .kill_and_wait(END_LIMIT)
            .inspect_err(|k| tracing::error!("ending the destination Firecracker: {k}"))
            .unwrap_or(false);
        let e = match ended {
            true => abandon(&mut wire, e),
            false => {
                tracing::error!(
                    "the destination Firecracker was not seen to exit within {END_LIMIT:?} of a failed resume; the source is not told to resume its copy"
                );
                drainer.drain();
                e
            }
        };
        let _ = run.join();
        return Err(e);
    }
    // The VM runs here: from now on it is served, and ends only as a served VM ends.
    drop(end_on_panic);
    // Asked to stop from now on: the server drains (the VM's memory brought in whole; it
    // runs on without this server), not a VM left waiting on a server gone.
    let stop_watch = m.stop.as_ref().map(|stop| {
        let (stop, served, drainer) = (Arc::clone(stop), Arc::clone(&served_fd), drainer.clone());
        std::thread::spawn(move || {
            let mut fds = [
                crate::sys::PollFd::readable(stop.as_fd()),
                crate::sys::PollFd::readable(served.as_fd()),
            ];
            if crate::sys::poll(&mut fds, None).is_ok() && fds[0].ready() && !fds[1].ready() {
                tracing::warn!(
                    "asked to stop: draining (the VM's memory brought in whole; it runs on without this server)"
                );
                drainer.drain();
            }
        })
    });
    if let Err(e) = wire.send(&Msg::Running, &[]) {
        // The VM runs here: it is served on whatever the source does now.
        tracing::error!("the VM runs here, but telling the source failed: {e}");
    }
    drop(hold);
    if frames.cache().is_some() && m.server.prefetch_threads > 0 {
        frames.ahead(&ahead, crate::snapshot::Ahead::Guessed, None);
    }
    let t_run = Instant::now();
    tracing::info!(
        "VM {} moved here from {} ({owed_frames} frames owed by it); chain on {}",
        name_url.name,
        wire.peer(),
        base_url
    );
    // Until the store holds the diff, the source owes its frames. A source that goes away
    // before then leaves them owed: a fault on one waits up to the deadline, then the VM
    // is ended with the reason.
    let mut released_ms = None;
    // However long the push takes (retried, of a large diff, to a distant store), until
    // the source says where it is, closes, or the VM is no longer served here.
    let mut source_gone = false;
    let pushed = match wire.wait_readable_or(served_fd.as_fd()) {
        Ok(true) => wire.recv(m.wait).inspect_err(|_| source_gone = true),
        Ok(false) => Err(MoveError::Wire {
            peer: wire.peer().into(),
            reason: "the VM is no longer served here".into(),
        }),
        Err(e) => {
            source_gone = true;
            Err(e)
        }
    };
    match pushed {
        Ok(Msg::Pushed { url }) => {
            match released(&frames, &url, &chain, &placeholders) {
                Ok(()) => {
                    frames.release();
                    released_ms = Some(t_run.elapsed().as_secs_f64() * 1e3);
                    let _ = wire.send(&Msg::Released, &[]);
                    tracing::info!(
                        "the diff of {} is in the store as {url}: the source is no longer needed",
                        name_url.name
                    );
                }
                Err(e) => {
                    tracing::error!("the source says the diff is at {url}, but: {e}; still following the source");
                    wire.refuse(e);
                }
            }
        }
        Ok(other) => {
            tracing::error!("move: expected Pushed, got {other:?}; still following the source")
        }
        Err(e) => tracing::error!("move: {e}; the source still owes {owed_frames} frames"),
    }
    // A source that went without a word (the connection broke after the commit, or it
    // failed to hear the VM runs here) pushes its diff as the move's name before it stops
    // serving: it is looked for in the store, so that owed faults, retrying to their
    // deadline, find it there.
    if source_gone && released_ms.is_none() {
        let t = Instant::now();
        let served = served_fd.as_fd();
        if look_in_store(
            &frames,
            &name_url,
            &chain,
            &placeholders,
            served,
            STORE_LOOK_LIMIT,
        ) {
            frames.release();
            released_ms = Some(t_run.elapsed().as_secs_f64() * 1e3);
            tracing::info!(
                "the diff of {} is in the store as {name_url} ({:.1} s after the source went): the source is no longer needed",
                name_url.name,
                t.elapsed().as_secs_f64()
            );
        }
    }
    // Once released, the source may go; while this side still follows it, the connection
    // stays open until the VM is no longer served (the source serves its frames until
    // then).
    let wire = match released_ms {
        Some(_) => {
            drop(wire);
            None
        }
        None => Some(wire),
    };
    let server = run.join();
    if let Some(w) = stop_watch {
        // The server has returned, so `served` is readable: the watch has ended or ends.
        let _ = w.join();
    }
    let server = server.map_err(|_| MoveError::Io {
        op: "serve (its thread panicked)",
        path: m.dir.clone(),
        source: std::io::Error::other("page server thread panicked"),
    })??;
    drop(wire);
    let c = &frames.counters;
    Ok(MoveInReport {
        base: base_url.to_string(),
        name: name_url.name.clone(),
        owed_frames,
        open_ms,
        load_ms,
        released_ms,
        peer_gets: c.peer_gets.load(std::sync::atomic::Ordering::Relaxed),
        peer_bytes: c.peer_bytes.load(std::sync::atomic::Ordering::Relaxed),
        peer_latency: c.peer_latency(),
        peer_fault_latency: c.peer_fault_latency(),
        peer_fault_wait: c.peer_fault_wait(),
        peer_fault_wait_exact: c.peer_fault_wait_exact(),
        server: Some(server),
    })
}

/// Forgets the placeholders of a chain named later (those it holds) when dropped.
struct ForgetLater<'a>(std::sync::Mutex<Vec<blake3::Hash>>, &'a Frames);

impl Drop for ForgetLater<'_> {
    fn drop(&mut self) {
        let names = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        self.1.forget_later(names);
    }
}

struct RemovedOnDrop(PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
