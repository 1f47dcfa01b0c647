//! `guestmem serve-uffd`: a page server for one Firecracker snapshot restore.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::{Args as ClapArgs, ValueEnum};
use guestmem::plan::parse_size;
use guestmem::restore::remote::{
    self, Listener, MemoryFile, ServeConfig, ServeLog, WorkingSetFile,
};

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
    #[arg(long, value_parser = secs)]
    accept_timeout_s: Option<f64>,
    /// Drop a connection that has not sent its whole handshake within this many seconds
    /// (and listen on for the real VM).
    #[arg(long, default_value = "5", value_parser = secs)]
    handshake_timeout_s: f64,
    /// What to do to a VM that sent its userfaultfd and then cannot be served (its vCPUs
    /// would wait for ever): every refusal and serving failure after that point.
    #[arg(long, value_enum, default_value = "kill")]
    on_failure: OnFailure,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnFailure {
    /// SIGKILL the VM's process (through the pidfd taken when it connected), so it ends
    /// rather than hangs.
    Kill,
    /// Leave it (it hangs on the memory that never arrives).
    Leave,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1e9 => Ok(v),
        _ => Err(format!("{s:?}: a number of seconds above 0 (at most 1e9)")),
    }
}

/// Runs `guestmem serve-uffd`: everything that can be refused is refused before the socket
/// appears, then one VM is served (see `guestmem::restore::remote::serve_one`).
pub fn run(a: Args) -> Result<()> {
    let mem = MemoryFile::open(&a.mem_file)?;
    let first = match &a.prefetch {
        Some(p) => WorkingSetFile::read(p)?,
        None => Vec::new(),
    };
    if let Some(path) = &a.record {
        WorkingSetFile::check_writable(path)?;
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cfg = ServeConfig {
        handler_threads: a.threads.map_or(cpus, |t| t as usize),
        prefetch_threads: a
            .prefetch_threads
            .map_or(if a.prefetch.is_some() { cpus } else { 0 }, |t| t as usize),
        first,
        block_bytes: a.block,
        on_failure: match a.on_failure {
            OnFailure::Kill => remote::OnFailure::Kill,
            OnFailure::Leave => remote::OnFailure::Leave,
        },
        handshake_timeout: Duration::from_secs_f64(a.handshake_timeout_s),
        accept_timeout: a.accept_timeout_s.map(Duration::from_secs_f64),
        log: ServeLog::stderr("guestmem serve-uffd: "),
    };
    cfg.check()?;
    let listener = Listener::bind(&a.socket)?;
    eprintln!("guestmem serve-uffd: listening on {}", a.socket.display());
    let report = remote::serve_one(listener, &mem, &cfg)?;
    if let Some(path) = &a.record {
        WorkingSetFile::write(path, &report.working_set)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let e = &report.engine;
        println!(
            "served {:.3} s until the {}; {} faults ({} brought a block in, {} waited on one \
             coming, {} came late), {} blocks prefetched, {} zero blocks, {} MiB copied, {} \
             removes; {} of {} blocks in",
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
