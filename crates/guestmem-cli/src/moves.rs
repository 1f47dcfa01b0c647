//! `guestmem move` (on the source host) and `guestmem move-in` (on the destination): a
//! running Firecracker VM moved between hosts with a pause of milliseconds (docs/move.md).

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use guestmem::migrate::{self, MoveIn, MoveKey, MoveOut};
use guestmem::serve::{ServeLog, ServerConfig, Vms};
use guestmem::store::{Client, StoreUrl};

use crate::report::{bytes, write_json};

/// Flags of `guestmem move`.
#[derive(ClapArgs)]
pub struct Out {
    /// The source Firecracker's API socket (its VM restored from --base with
    /// `track_dirty_pages: true`).
    #[arg(long)]
    api: PathBuf,
    /// The snapshot in the store the VM was restored from: s3://BUCKET/NAME.
    #[arg(long)]
    base: String,
    /// The name its diff gets in the store (new; in the base's bucket).
    #[arg(long = "as")]
    name: String,
    /// The destination's `guestmem move-in`: HOST:PORT.
    #[arg(long)]
    to: SocketAddr,
    /// Where this host serves the diff's frames until the store holds them.
    #[arg(long, default_value = "0.0.0.0:0")]
    listen: SocketAddr,
    /// The URL the destination reaches them at (default: http://, this host's address
    /// toward the destination, the port listened on).
    #[arg(long)]
    advertise: Option<String>,
    /// Where Firecracker writes the diff (removed when the move ends). A tmpfs: the Diff
    /// snapshot is most of the pause, and on tmpfs it took a quarter of the time it took on
    /// ext4 here (docs/move.md).
    #[arg(long, default_value = "/run/guestmem/move")]
    work_dir: PathBuf,
    /// Threads hashing and pushing the diff.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=64))]
    threads: u32,
    /// The move key both hosts hold: a file of 32 to 4096 secret bytes that only its owner
    /// may read (`head -c 32 /dev/urandom > FILE; chmod 600 FILE`), the same on both hosts.
    /// With it, the control connection is authenticated message by message and the diff's
    /// frames are served only to requests with this move's token; nothing is encrypted
    /// (docs/move.md, Security). Without it (on both hosts), nothing is authenticated.
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Flags of `guestmem move-in`.
#[derive(ClapArgs)]
pub struct In {
    /// Where to wait for the source's `guestmem move`: ADDR:PORT.
    #[arg(long)]
    listen: SocketAddr,
    /// The destination Firecracker's API socket (a process started, nothing loaded).
    #[arg(long)]
    api: PathBuf,
    /// Where the vmstate and the page server's socket go.
    #[arg(long, default_value = "/run/guestmem/move")]
    dir: PathBuf,
    /// The host's frame cache (shared with serve-uffd).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Its bound.
    /// [default: the bound the folder was last opened with, else 16G]
    #[arg(long, value_parser = crate::store::cache_size, requires = "cache_dir")]
    cache_size: Option<u64>,
    /// How long a fault waits for its frame (from the store or the source), retries
    /// included, before the VM is ended with the reason.
    #[arg(long, default_value = "30", value_parser = secs)]
    fetch_deadline: f64,
    /// How long to wait for the source: its connection and each of its messages.
    #[arg(long, default_value = "600", value_parser = secs)]
    wait: f64,
    /// Fault-handling threads (default: one per CPU).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// The move key both hosts hold: a file of 32 to 4096 secret bytes that only its owner
    /// may read (`head -c 32 /dev/urandom > FILE; chmod 600 FILE`), the same on both hosts.
    /// With it, the control connection is authenticated message by message and the diff's
    /// frames are served only to requests with this move's token; nothing is encrypted
    /// (docs/move.md, Security). Without it (on both hosts), nothing is authenticated.
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (1e-3..=1e9).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: a number of seconds from 0.001 to 1e9")),
    }
}

/// SIGINT and SIGTERM taken as [`crate::signals::watch`] takes them: the first writes
/// `stop` (a move's stop).
fn watch_signals(first: &'static str, stop: Arc<OwnedFd>) -> Result<()> {
    crate::signals::watch(first, "the move where it stands", move || {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to an eventfd this closure holds.
        unsafe { libc::write(stop.as_raw_fd(), one.as_ptr().cast(), 8) };
    })
}

/// What `move` and `move-in` set up first: their log on stderr, and a move's stop, which
/// the first SIGINT or SIGTERM writes (saying `first`; see [`watch_signals`]).
fn logs_and_stop(first: &'static str) -> Result<Arc<OwnedFd>> {
    crate::serve_uffd::init_logs(crate::serve_uffd::LogFormat::Text);
    let stop = stop_fd()?;
    watch_signals(first, Arc::clone(&stop))?;
    Ok(stop)
}

/// An eventfd for a move's stop.
fn stop_fd() -> Result<Arc<OwnedFd>> {
    // SAFETY: eventfd takes flags only and returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("make an eventfd");
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// `guestmem move`.
pub fn run_out(a: Out) -> Result<()> {
    // Not ended mid-pause by a Ctrl-C: every step of a move is bounded, and it ends with
    // the VM resumed here or running there (docs/move.md).
    let stop = logs_and_stop(
        "stopping: a move not yet paused ends; one in its pause goes on to its end (each step is bounded; the VM resumes here or runs there); past a commit the destination did not answer, the wait for its word ends (the VM left paused here, its writes pushed)",
    )?;
    let base = StoreUrl::parse(&a.base, false).context("--base")?;
    let push_as = base.sibling(&a.name);
    StoreUrl::parse(&push_as.to_string(), false).context("--as")?;
    let store = Arc::new(Client::connect(&base.bucket)?);
    let m = MoveOut {
        api: a.api,
        base,
        push_as,
        to: a.to,
        listen: a.listen,
        advertise: a.advertise,
        work_dir: a.work_dir,
        threads: a.threads as usize,
        key: a.key_file.as_deref().map(MoveKey::from_file).transpose()?,
        stop: Some(stop),
    };
    let r = migrate::move_out(&m, &store)?;
    if a.json {
        return write_json(&mut std::io::stdout().lock(), &r);
    }
    let p = &r.pause;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "moved in a pause of {:.1} ms: pause {:.1}, diff snapshot {:.1}, vmstate sent {:.1}, frames {:.1} (the destination's load {:.1} beside them), wait {:.1} (its chain opened {:.1}), commit {:.1}",
        p.total_ms, p.pause_ms, p.snapshot_ms, p.send_ms, p.frames_ms, p.load_ms, p.wait_ms, p.open_ms, p.commit_ms
    )?;
    writeln!(
        out,
        "diff {} (vmstate {}); sent {} in {} GETs; pushed as {} ({} stored)",
        bytes(r.diff_bytes),
        bytes(r.vmstate_bytes),
        bytes(r.bytes_sent),
        r.gets_served,
        r.pushed,
        bytes(r.push.bytes_stored)
    )?;
    writeln!(
        out,
        "window of risk (the pause to the destination released): {:.1} ms",
        r.risk_ms
    )?;
    Ok(())
}

/// `guestmem move-in`.
pub fn run_in(a: In) -> Result<()> {
    let stop = logs_and_stop(
        "stopping: a move not yet run here is refused (the source resumes its VM); a VM running here is drained (its memory brought in whole, then it runs on without this server)",
    )?;
    let mut stores = crate::store::Stores::new(
        a.cache_dir.as_deref(),
        a.cache_size,
        Duration::from_secs_f64(a.fetch_deadline),
    )?;
    guestmem::migrate::private_dir(&a.dir).with_context(|| format!("--dir {}", a.dir.display()))?;
    let listener = TcpListener::bind(a.listen).with_context(|| format!("--listen {}", a.listen))?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let wait = Duration::from_secs_f64(a.wait);
    let m = MoveIn {
        api: a.api,
        dir: a.dir,
        server: ServerConfig {
            handler_threads: a.threads.map_or(cpus, |t| t as usize),
            prefetch_threads: cpus,
            vms: Vms::One {
                wait: Some(Duration::from_secs(60)),
            },
            log: ServeLog::default(),
            ..ServerConfig::default()
        },
        wait,
        key: a.key_file.as_deref().map(MoveKey::from_file).transpose()?,
        stop: Some(stop),
    };
    eprintln!("waiting for a move on {}", listener.local_addr()?);
    let r = migrate::move_in(&listener, &m, &mut |u| {
        stores
            .frames(&u.bucket)
            .map_err(|e| guestmem::store::StoreError::Config {
                bucket: u.bucket.clone(),
                reason: format!("{e:#}"),
            })
    })?;
    if a.json {
        return write_json(&mut std::io::stdout().lock(), &r);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "VM {} from {}: open {:.1} ms, load {:.1} ms; {} frames owed, {} in {} GETs from the source (p50 {:.0} us, p99 {:.0} us); {} remote faults (waited p50 {:.0} us, p99 {:.0} us); {}",
        r.name,
        r.base,
        r.open_ms,
        r.load_ms,
        r.owed_frames,
        bytes(r.peer_bytes),
        r.peer_gets,
        r.peer_latency.p50_us,
        r.peer_latency.p99_us,
        r.peer_fault_wait.count,
        r.peer_fault_wait.p50_us,
        r.peer_fault_wait.p99_us,
        match r.released_ms {
            Some(ms) => format!("source released {ms:.0} ms after the VM ran"),
            None => "the source was never released".into(),
        }
    )?;
    if let Some(s) = r.server.as_ref().and_then(|s| s.last.as_ref()) {
        writeln!(out, "served until: {:?}", s.end)?;
    }
    Ok(())
}
