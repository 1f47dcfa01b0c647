//! The source host's side of a move: offer, pause, diff, serve its frames, hand over, end
//! the source VM, push the diff, release the destination.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::firecracker::{json_path, Api};
use super::wire::{Msg, Side, Wire, WIRE_VERSION};
use super::{MoveError, MoveKey, OnPanic};
use crate::store::{
    name_later, push, push_held, Client, HeldFrames, PeerServer, PushConfig, PushReport,
    PushSource, StoreUrl,
};

/// How long the destination may take to answer a message (reading the base's manifest,
/// loading the vmstate, reading the pushed manifest).
const ANSWER_LIMIT: Duration = Duration::from_secs(120);
/// Firecracker's API requests: pausing, resuming, writing a diff.
const API_LIMIT: Duration = Duration::from_secs(120);
/// How long the destination may take from the hand-over to the VM loaded: it reads the
/// vmstate, opens the chain and loads within [`super::into::LOAD_LIMIT`] of its own.
const LOAD_LIMIT: Duration = Duration::from_secs(150);
/// How long the source waits for the destination's word after its Commit: past the
/// destination's own limit on its resume ([`super::into::LOAD_LIMIT`]), so that a
/// destination that gives up says so (and the copy here resumes) before this runs out.
const COMMIT_LIMIT: Duration = Duration::from_secs(super::into::LOAD_LIMIT.as_secs() + 60);
/// How long the destination may take to read the pushed manifest and let go.
const RELEASE_LIMIT: Duration = Duration::from_secs(60);
/// Pushes of the diff tried before giving up (the client retries each request too).
const PUSH_ATTEMPTS: u32 = 3;

/// A move of one Firecracker VM, as the source host runs it.
#[derive(Debug, Clone)]
pub struct MoveOut {
    /// The source Firecracker's API socket.
    pub api: PathBuf,
    /// The snapshot in the store the VM was restored from (with `track_dirty_pages`).
    pub base: StoreUrl,
    /// Where the diff goes in the store (a new name in the base's bucket).
    pub push_as: StoreUrl,
    /// The destination's `move-in`.
    pub to: SocketAddr,
    /// Where this host serves the diff's frames (port 0: any free one).
    pub listen: SocketAddr,
    /// The URL the destination reaches them at; by default `http://` this host's address
    /// toward the destination, and the port listened on.
    pub advertise: Option<String>,
    /// Where Firecracker writes the diff (removed when the move ends).
    pub work_dir: PathBuf,
    /// Threads hashing the diff.
    pub threads: usize,
    /// The move key both hosts hold (`None`: the move is not authenticated; the
    /// destination must have none either). See [`MoveKey`].
    pub key: Option<MoveKey>,
    /// Readable once the move is to stop (an eventfd a signal's watcher writes, say):
    /// before the pause, nothing is paused and the move ends; in the pause, every step is
    /// bounded and the move goes on to its end; after a commit the destination did not
    /// answer in time, the wait for its late word ends (the VM left paused here, as when
    /// the destination closes, and its writes pushed). `None`: never.
    pub stop: Option<Arc<std::os::fd::OwnedFd>>,
}

/// The pause, step by step (milliseconds).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PauseSteps {
    /// `PATCH /vm Paused`.
    pub pause_ms: f64,
    /// `PUT /snapshot/create` Diff: Firecracker writes the vmstate and the dirty pages.
    pub snapshot_ms: f64,
    /// The vmstate sent to the destination, which starts loading it.
    pub send_ms: f64,
    /// The chain's manifest made, while the destination loads: from the diff's shape
    /// (`SEEK_DATA`), its pieces named later; or, for a chain too deep for that, the diff
    /// cut into frames and hashed.
    pub frames_ms: f64,
    /// From the chain's manifest sent to the destination's word that the VM is loaded: what
    /// of the load the frames did not hide, the chain opened there, and a round trip.
    pub wait_ms: f64,
    /// On the destination: the chain checked and served (its page server listening).
    pub open_ms: f64,
    /// On the destination: Firecracker's `snapshot/load`, the VM left paused, from the
    /// vmstate's arrival (beside `frames_ms`, not after it).
    pub load_ms: f64,
    /// The commit: its message, the destination's `PATCH /vm Resumed`, its answer.
    pub commit_ms: f64,
    /// From `PATCH /vm Paused` to the destination's word that the VM runs.
    pub total_ms: f64,
}

/// What a move did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MoveReport {
    /// The pause, step by step.
    pub pause: PauseSteps,
    /// Bytes of memory the diff holds (the pages written since the restore).
    pub diff_bytes: u64,
    /// Bytes of the vmstate.
    pub vmstate_bytes: u64,
    /// Bytes of frames this host served to the destination.
    pub bytes_sent: u64,
    /// Frame GETs it answered.
    pub gets_served: u64,
    /// The push of the diff to the store.
    pub push: PushReport,
    /// From the pause until the destination no longer needed this host: the window in
    /// which losing this host loses the VM.
    pub risk_ms: f64,
    /// Where the diff is in the store.
    pub pushed: String,
}

/// Moves the VM behind `m.api` to the destination's `move-in` at `m.to`.
pub fn move_out(m: &MoveOut, store: &Arc<Client>) -> Result<MoveReport, MoveError> {
    let (api, process) = Api::open(&m.api, "source")?;
    // Everything that can be checked before the pause is.
    let (base, vmstate, memfile) = super::ready::before_the_pause(
        super::ready::Move {
            base: &m.base,
            push_as: &m.push_as,
            work_dir: &m.work_dir,
        },
        store,
    )?;
    let io = |op, path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| MoveError::Io { op, path, source }
    };
    let mut files = Removed(vec![vmstate.clone(), memfile.clone()]);
    let held = Arc::new(Client::in_memory(&m.push_as.name)?);
    let held_frames = Arc::new(HeldFrames::new());
    // With a key, the frames are served only to the side that proved it holds it.
    let peer = match m.key {
        Some(_) => PeerServer::start_locked(m.listen, Arc::clone(&held_frames), Arc::clone(&held))?,
        None => PeerServer::start(m.listen, Arc::clone(&held_frames), Arc::clone(&held))?,
    };
    let ctl = TcpStream::connect_timeout(&m.to, Duration::from_secs(10)).map_err(|e| {
        MoveError::Wire {
            peer: m.to.to_string(),
            reason: format!("connect: {e}"),
        }
    })?;
    let advertise = match &m.advertise {
        Some(a) => a.clone(),
        None => {
            let ip = match m.listen.ip().is_unspecified() {
                true => ctl
                    .local_addr()
                    .map_err(|e| MoveError::Wire {
                        peer: m.to.to_string(),
                        reason: e.to_string(),
                    })?
                    .ip(),
                false => m.listen.ip(),
            };
            format!("http://{}", SocketAddr::new(ip, peer.addr().port()))
        }
    };
    let mut wire = Wire::new(ctl)?;
    match wire.hello(Side::Source, m.key.as_ref(), ANSWER_LIMIT)? {
        Some(session) => peer.unlock(session.read_token(), session.piece_key()),
        None => tracing::warn!(
            "moving {} without a move key: anyone who can reach {} can read the VM's diff while the move runs, and anyone who can reach {} can take the move's place (docs/move.md, Security)",
            m.api.display(),
            advertise,
            m.to
        ),
    }
    wire.send(
        &Msg::Offer {
            version: WIRE_VERSION,
            base: m.base.to_string(),
            peer: advertise,
            name: m.push_as.name.clone(),
        },
        &[],
    )?;
    match wire.recv(ANSWER_LIMIT)? {
        Msg::Ready { version } if version == WIRE_VERSION => {}
        Msg::Ready { version } => {
            return Err(MoveError::Refused {
                side: "destination",
                reason: format!(
                    "it speaks move messages v{version}, this host v{WIRE_VERSION}; nothing paused"
                ),
            })
        }
        Msg::Refused { reason } => {
            return Err(MoveError::Refused {
                side: "destination",
                reason,
            })
        }
        other => return Err(unexpected(&wire, "Ready", &other)),
    }
    let stop = m.stop.as_ref().map(|f| {
        use std::os::fd::AsFd;
        f.as_fd()
    });
    if stop.is_some_and(crate::sys::is_readable) {
        let reason = "asked to stop before the pause; nothing paused".to_string();
        let _ = wire.send(
            &Msg::Abort {
                reason: reason.clone(),
            },
            &[],
        );
        return Err(MoveError::Refused {
            side: "source",
            reason,
        });
    }

    // The diff to the store, as a layer on the base (after the move, or after a failed one).
    let push_diff = || {
        push(
            store,
            &PushSource::RawDiff {
                path: memfile.clone(),
                base: m.base.clone(),
            },
            &m.push_as,
            &PushConfig {
                frame_bytes: base.frame_bytes(),
                threads: m.threads.max(1),
                base: Some(Arc::clone(&base)),
                ..PushConfig::default()
            },
        )
    };
    // Firecracker clears its dirty log at the Diff: a later move on the same base would miss
    // the writes this one holds. So a move that fails past the Diff (before the commit or
    // after it) pushes them as the base for the next, or keeps the file and says so.
    let keep_writes = |files: &mut Removed| match push_diff() {
        Ok(_) => format!(
            "; its writes until the pause are in {} (a new move must use --base {})",
            m.push_as, m.push_as
        ),
        Err(p) => {
            files.0.clear();
            format!(
                "; its writes until the pause could not be pushed ({p}): they are kept in {} (push them with --base {} before a new move)",
                memfile.display(),
                m.base
            )
        }
    };

    // The pause. Until the destination has the VM loaded and this side commits, any
    // failure resumes the VM here.
    let mut steps = PauseSteps::default();
    let t0 = Instant::now();
    // Whether the Diff was asked for, and whether Firecracker said it wrote it: it reads
    // (and so clears) its dirty log before it writes the pages, so a Diff that failed may
    // have taken writes a later move on the same base would miss.
    let (mut diff_asked, mut snapshotted) = (false, false);
    let mut paused = || -> Result<(u64, Vec<u8>), MoveError> {
        api.ok("PATCH", "vm", r#"{"state":"Paused"}"#, API_LIMIT)?;
        steps.pause_ms = ms(t0);
        let t = Instant::now();
        diff_asked = true;
        api.ok(
            "PUT",
            "snapshot/create",
            &format!(
                r#"{{"snapshot_type":"Diff","snapshot_path":{},"mem_file_path":{}}}"#,
                json_path(&vmstate),
                json_path(&memfile)
            ),
            API_LIMIT,
        )?;
        snapshotted = true;
        steps.snapshot_ms = ms(t);
        // The vmstate first: the destination loads it while this side cuts the frames.
        let t = Instant::now();
        let state = std::fs::read(&vmstate).map_err(io("read", &vmstate))?;
        wire.send(
            &Msg::State {
                vmstate_bytes: state.len() as u64,
            },
            &state,
        )?;
        steps.send_ms = ms(t);
        let t = Instant::now();
        // The chain's manifest from the diff's shape, its pieces named later: nothing of it
        // read or hashed in the pause. A chain too deep for that is cut here.
        let (manifest, later, diff_bytes) =
            match name_later(&memfile, &base, &m.push_as, &held_frames)? {
                Some(named) => (named.manifest, true, named.diff_bytes),
                None => {
                    // Threads past the CPUs only wait on each other: nothing is uploaded.
                    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
                    let cfg = PushConfig {
                        frame_bytes: base.frame_bytes(),
                        threads: m.threads.clamp(1, cpus),
                        compress: false,
                        base_from: Some(Arc::clone(store)),
                        base: Some(Arc::clone(&base)),
                        look_first: false,
                        reused_file_ok: false,
                        stop: None,
                    };
                    let cut = push_held(
                        &held,
                        &PushSource::RawDiff {
                            path: memfile.clone(),
                            base: m.base.clone(),
                        },
                        &m.push_as,
                        &cfg,
                        &held_frames,
                    )?;
                    let manifest =
                        held.get(&m.push_as.manifest_key())?
                            .ok_or_else(|| MoveError::Io {
                                op: "read the manifest just made of",
                                path: memfile.clone(),
                                source: std::io::Error::from(std::io::ErrorKind::NotFound),
                            })?;
                    (manifest.to_vec(), false, cut.bytes_read)
                }
            };
        steps.frames_ms = ms(t);
        let t = Instant::now();
        wire.send(
            &Msg::Diff {
                manifest_bytes: manifest.len() as u64,
                later,
            },
            &manifest,
        )?;
        match wire.recv(LOAD_LIMIT)? {
            Msg::Loaded { load_ms, open_ms } => {
                steps.load_ms = load_ms;
                steps.open_ms = open_ms;
                steps.wait_ms = ms(t);
            }
            Msg::Refused { reason } => {
                return Err(MoveError::Refused {
                    side: "destination",
                    reason,
                })
            }
            other => return Err(unexpected(&wire, "Loaded", &other)),
        }
        Ok((diff_bytes, state))
    };
    // A panic in the pause resumes the VM here on its way out: it is never left paused
    // with no one to resume it. (An error resumes it below, saying why.)
    let resume_on_panic = OnPanic(|| {
        let resumed = api.ok("PATCH", "vm", r#"{"state":"Resumed"}"#, API_LIMIT);
        tracing::error!(
            "the move of {} panicked in the pause; the VM resumed here: {}",
            m.api.display(),
            resumed.map_or_else(|e| format!("no: {e}"), |_| "yes".into())
        );
    });
    let paused = paused();
    // Dropped here, before the commit: from then on this side never resumes its copy.
    drop(resume_on_panic);
    let (diff_bytes, state) = match paused {
        Ok(v) => v,
        Err(e) => {
            // Resumed first: the destination never resumes without a Commit, and a send to
            // a destination that stopped reading may take its whole limit.
            let resumed = api.ok("PATCH", "vm", r#"{"state":"Resumed"}"#, API_LIMIT);
            let _ = wire.send(
                &Msg::Abort {
                    reason: e.to_string(),
                },
                &[],
            );
            tracing::warn!("move of {} failed after the pause: {e}", m.api.display());
            let kept = match (snapshotted, diff_asked) {
                (true, _) => keep_writes(&mut files),
                (false, true) => format!(
                    "; Firecracker's Diff snapshot failed, and it may have cleared its dirty log first: a move on --base {} could miss writes made before this pause, so push a Full snapshot of the VM as its base before a new move",
                    m.base
                ),
                (false, false) => String::new(),
            };
            return Err(MoveError::Failed {
                reason: format!("{e}{kept}"),
                resumed: resumed.is_ok(),
                resume: resumed.err().map_or(String::new(), |e| e.to_string()),
            });
        }
    };
    // The commit: from here this side never resumes its copy.
    let t_commit = Instant::now();
    let committed = wire
        .send(&Msg::Commit, &[])
        .and_then(|_| wire.recv(COMMIT_LIMIT));
    // No answer in time: the destination may still be resuming, or have given up and be
    // about to say so. Its word is waited for (a connection that closed ends the wait at
    // once): a late Refused resumes the copy here, a late Running goes on as a move.
    let committed = match committed {
        Err(e) => {
            tracing::error!(
                "move committed but the destination did not answer within {COMMIT_LIMIT:?} ({e}); the source VM stays paused until it does"
            );
            match wire.recv_unless(Duration::from_secs(u32::MAX as u64), stop) {
                Ok(Some(m)) => Ok(m),
                Ok(None) => Err(MoveError::Wire {
                    peer: wire.peer().into(),
                    reason: "asked to stop while waiting for the destination's word".into(),
                }),
                Err(e) => Err(e),
            }
        }
        answer => answer,
    };
    match committed {
        Ok(Msg::Running) => {}
        Ok(Msg::Refused { reason }) => {
            // The destination ended its copy: the source's is the only one.
            let resumed = api.ok("PATCH", "vm", r#"{"state":"Resumed"}"#, API_LIMIT);
            let kept = keep_writes(&mut files);
            return Err(MoveError::Failed {
                reason: format!("the destination could not resume the VM: {reason}{kept}"),
                resumed: resumed.is_ok(),
                resume: resumed.err().map_or(String::new(), |e| e.to_string()),
            });
        }
        other => {
            // Whether the destination runs the VM cannot be known from here: the source
            // copy stays paused (never two copies running). Its frames are served until the
            // diff is pushed, as the move's name, where a destination that runs the VM and
            // lost this connection looks for it (`into::look_in_store`).
            let why = match other {
                Ok(m) => format!("expected Running, got {m:?}"),
                Err(e) => e.to_string(),
            };
            tracing::error!(
                "move committed but the destination did not confirm ({why}); the source VM is left paused, not ended"
            );
            // Whichever copy runs on, its base is this diff.
            let kept = keep_writes(&mut files);
            return Err(MoveError::Wire {
                peer: wire.peer().into(),
                reason: format!("after the commit: {why}; the source VM is left paused (the destination may run it){kept}"),
            });
        }
    }
    steps.commit_ms = ms(t_commit);
    steps.total_ms = ms(t0);
    // The VM runs on the destination: the source's copy ends now, never before.
    if let Err(e) = process.kill() {
        tracing::warn!(
            "the VM runs on the destination, but ending the source Firecracker failed: {e}"
        );
    }
    tracing::info!(
        "VM moved to {} in a pause of {:.1} ms; pushing its diff to {}",
        wire.peer(),
        steps.total_ms,
        m.push_as
    );

    // The window of risk: until the store holds the diff and the destination reads it.
    // The push retries; the frames stay served until the destination lets go.
    let mut pushed = None;
    for attempt in 1..=PUSH_ATTEMPTS {
        match push_diff() {
            Ok(r) => {
                pushed = Some(r);
                break;
            }
            Err(e) => {
                tracing::error!(
                    "push of the diff to {} failed (attempt {attempt}): {e}",
                    m.push_as
                );
                std::thread::sleep(Duration::from_secs(attempt as u64));
            }
        }
    }
    let Some(report) = pushed else {
        // The destination still needs this host: serve it until it goes, and keep the diff.
        files.0.clear();
        tracing::error!(
            "the diff could not be pushed to {}; kept in {}; serving its frames until the destination closes",
            m.push_as,
            memfile.display()
        );
        let _ = wire.recv(Duration::from_secs(u32::MAX as u64));
        return Err(MoveError::Failed {
            reason: format!(
                "the VM runs on the destination, but its diff could not be pushed to {} (kept in {})",
                m.push_as,
                memfile.display()
            ),
            resumed: false,
            resume: "it was not to be: the destination runs it".into(),
        });
    };
    let released = wire
        .send(
            &Msg::Pushed {
                url: m.push_as.to_string(),
            },
            &[],
        )
        .and_then(|()| wire.recv(RELEASE_LIMIT));
    if !matches!(released, Ok(Msg::Released)) {
        // The destination may still follow this host (it could not read the pushed
        // manifest yet, or is slow to say so): its frames stay served until it closes, or
        // its owed faults would fail at its fetch deadline.
        let why = match &released {
            Ok(other) => format!("expected Released, got {other:?}"),
            Err(e) => e.to_string(),
        };
        tracing::error!(
            "the diff is in {}, but the destination did not let go ({why}); serving its frames until it closes",
            m.push_as
        );
        let late = wire.recv(Duration::from_secs(u32::MAX as u64));
        if !matches!(late, Ok(Msg::Released)) {
            return Err(match released {
                Ok(other) => unexpected(&wire, "Released", &other),
                Err(e) => e,
            });
        }
    }
    let risk_ms = ms(t0);
    Ok(MoveReport {
        pause: steps,
        diff_bytes,
        vmstate_bytes: state.len() as u64,
        bytes_sent: peer.bytes_sent(),
        gets_served: peer
            .counters
            .gets
            .load(std::sync::atomic::Ordering::Relaxed),
        push: report,
        risk_ms,
        pushed: m.push_as.to_string(),
    })
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn unexpected(wire: &Wire, want: &str, got: &Msg) -> MoveError {
    MoveError::Wire {
        peer: wire.peer().into(),
        reason: format!("expected {want}, got {got:?}"),
    }
}

/// Files removed when dropped.
struct Removed(Vec<PathBuf>);

impl Drop for Removed {
    fn drop(&mut self) {
        for f in &self.0 {
            let _ = std::fs::remove_file(f);
        }
    }
}
