//! `guestmem serve-uffd`: a page server for one Firecracker snapshot restore.

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, ValueEnum};
use guestmem::plan::parse_size;
use guestmem::restore::remote::{Handshake, PageServer, ServeConfig, WorkingSetFile};

/// Flags of `guestmem serve-uffd`.
#[derive(ClapArgs)]
pub struct Args {
    /// Unix socket to listen on (Firecracker's `mem_backend.backend_path`).
    #[arg(long)]
    socket: PathBuf,
    /// The snapshot's memory file (Firecracker's, or a guestmem save's `memory`).
    #[arg(long)]
    mem_file: PathBuf,
    /// Threads serving faults [default: the CPUs].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// A recorded working set (from --record): prefetch it first, then the rest.
    #[arg(long)]
    prefetch: Option<PathBuf>,
    /// Threads prefetching [default: the CPUs with --prefetch, else 0: faults alone bring
    /// memory in]. Without --prefetch, a non-zero count prefetches in address order.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=1024))]
    prefetch_threads: Option<u32>,
    /// Write the blocks the VM faulted, in order, here when the VM goes away.
    #[arg(long)]
    record: Option<PathBuf>,
    /// Bytes served per fault.
    #[arg(long, default_value = "1M", value_parser = size)]
    block: u64,
    /// Give up when no VM connects within this many seconds [default: wait].
    #[arg(long)]
    accept_timeout_s: Option<f64>,
    /// What to do to the VM's process if serving fails (its vCPUs would wait for ever).
    #[arg(long, value_enum, default_value = "kill")]
    on_failure: OnFailure,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnFailure {
    /// SIGKILL the peer (from SO_PEERCRED), so it dies rather than hangs.
    Kill,
    /// Leave it (it hangs on the memory that never arrives).
    Leave,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// How long a connected peer has to send its whole handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds `path`, replacing a stale socket (one nobody listens on) but nothing else.
fn bind(path: &Path) -> Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!("--socket {}: exists and is not a socket", path.display());
        }
        if UnixStream::connect(path).is_ok() {
            bail!("--socket {}: another server listens there", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("remove the stale socket {}", path.display()))?;
    }
    UnixListener::bind(path).with_context(|| format!("bind --socket {}", path.display()))
}

/// Removes the socket file when serving ends, however it ends.
struct Unlink<'a>(&'a Path);

impl Drop for Unlink<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// Runs `guestmem serve-uffd`.
pub fn run(a: Args) -> Result<()> {
    // Refuse what can be refused before a VM connects.
    let meta = std::fs::metadata(&a.mem_file)
        .with_context(|| format!("--mem-file {}", a.mem_file.display()))?;
    if !meta.is_file() {
        bail!("--mem-file {}: not a regular file", a.mem_file.display());
    }
    let first = match &a.prefetch {
        Some(p) => WorkingSetFile::read(p)?,
        None => Vec::new(),
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cfg = ServeConfig {
        handler_threads: a.threads.map_or(cpus, |t| t as usize),
        prefetch_threads: a
            .prefetch_threads
            .map_or(if a.prefetch.is_some() { cpus } else { 0 }, |t| t as usize),
        first,
        block_bytes: a.block,
    };
    let listener = bind(&a.socket)?;
    let _unlink = Unlink(&a.socket);
    eprintln!("guestmem serve-uffd: listening on {}", a.socket.display());
    let wait = a.accept_timeout_s.map_or(
        Duration::from_secs(u32::MAX as u64),
        Duration::from_secs_f64,
    );
    let h = Handshake::accept(&listener, wait, HANDSHAKE_TIMEOUT)?;
    drop(listener);
    let pid = h.peer_pid();
    eprintln!(
        "guestmem serve-uffd: peer {} sent {} regions ({} MiB)",
        pid.map_or("?".into(), |p| p.to_string()),
        h.regions().len(),
        h.regions().iter().map(|r| r.size).sum::<u64>() >> 20
    );
    let server = PageServer::start(h, &a.mem_file, &cfg)?;
    match server.wait() {
        Ok(report) => {
            if let Some(path) = &a.record {
                WorkingSetFile::write(path, &report.working_set)
                    .with_context(|| format!("--record {}", path.display()))?;
            }
            if a.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                let e = &report.engine;
                println!(
                    "served {:.3} s until the {}; {} faults ({} brought a block in, {} waited \
                     on one coming, {} came late), {} blocks prefetched, {} zero blocks, \
                     {} MiB copied, {} removes; {} of {} blocks in",
                    report.served_secs,
                    report.ended,
                    e.faults,
                    e.fault_blocks,
                    e.faults_on_busy,
                    e.faults_late,
                    e.prefetched_blocks,
                    e.zero_blocks,
                    e.bytes_copied >> 20,
                    e.removes,
                    e.fault_blocks + e.prefetched_blocks,
                    e.blocks
                );
            }
            Ok(())
        }
        Err(e) => {
            if let (OnFailure::Kill, Some(p)) = (a.on_failure, pid) {
                if p as u32 != std::process::id() {
                    // SAFETY: kill(2) takes a pid and a signal and touches no memory.
                    unsafe { libc::kill(p, libc::SIGKILL) };
                    eprintln!(
                        "guestmem serve-uffd: killed the peer {p}: its memory cannot be served"
                    );
                }
            }
            Err(e.into())
        }
    }
}
