//! `guestmem serve-uffd`: a page server for Firecracker snapshot restores: every VM that
//! connects, until SIGTERM (drained), or one VM with `--once`; one `guestmem::serve::Server`
//! either way.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, ValueEnum};
use guestmem::plan::parse_size;
use guestmem::serve::{
    self, Listener, MemoryFile, ServeLog, Server, ServerConfig, ServerReport, Socket, Vms,
    WorkingSetFile,
};
use guestmem::store::StoreUrl;

/// Flags of `guestmem serve-uffd`.
#[derive(ClapArgs)]
pub struct Args {
    /// Unix socket to listen on (Firecracker's `mem_backend.backend_path`). Repeat it, each
    /// with its --mem-file, to serve several snapshots.
    #[arg(long, required = true)]
    socket: Vec<PathBuf>,
    /// The snapshot's memory file (Firecracker's, or a guestmem save's `memory`), one per
    /// --socket, in the same order; or a snapshot in object storage, `s3://BUCKET/NAME`
    /// (pushed with `guestmem snapshot push`), its frames fetched as VMs read them (see
    /// --cache-dir).
    #[arg(long, required = true)]
    mem_file: Vec<PathBuf>,
    /// For s3:// snapshots: keep fetched frames here, shared by every VM and snapshot of
    /// this host and kept across restarts [default: no cache: every read is a GET].
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Most bytes --cache-dir holds (least recently used frames go first).
    /// [default: the bound the folder was last opened with, else 16G]
    #[arg(long, value_parser = crate::store::cache_size, requires = "cache_dir")]
    cache_size: Option<u64>,
    /// For s3:// snapshots: how long a fault waits for its frame (retries with backoff
    /// included) before serving the VM is given up and the VM ended with the reason.
    #[arg(long, default_value = "30", value_parser = secs)]
    fetch_deadline: f64,
    /// Serve one VM and exit when it goes (the server stops listening once it has it).
    #[arg(long)]
    once: bool,
    /// Most VMs served at once; the next is refused and ended with the reason.
    #[arg(long, default_value_t = serve::DEFAULT_MAX_VMS as u32, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_vms: u32,
    /// Most guest memory served at once, all VMs together (`64G`); past it a VM is refused
    /// and ended with the reason [default: no limit].
    #[arg(long, value_parser = size)]
    max_memory: Option<u64>,
    /// Keep a record of each VM served here, so that a server started after this one died
    /// (same --mem-file) takes its VMs back: their userfaultfds come back from the VMs
    /// (`pidfd_getfd`), and none is lost.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Learn each snapshot's working set from the VMs served (blocks faulted, first fault
    /// first, merged across VMs), keep it beside its memory file
    /// (`<mem-file>.guestmem-ws.json`, keyed by the file's identity) and prefetch it for
    /// every later VM of that snapshot, its own faults first.
    #[arg(long)]
    learn_working_sets: bool,
    /// Take over, without downtime, from the server whose control socket this is (a server
    /// being upgraded): its sockets and VMs are handed over (`SCM_RIGHTS`) and it exits;
    /// give the same --socket/--mem-file pairs.
    #[arg(long, conflicts_with = "once")]
    take_over: Option<PathBuf>,
    /// A control socket: one command a connection (`status`, `health`, `drain`, `metrics`);
    /// `guestmem serve-ctl --control PATH status` sends one.
    #[arg(long)]
    control: Option<PathBuf>,
    /// Serve Prometheus metrics (`GET /metrics`) and `GET /health` over HTTP here
    /// (`127.0.0.1:9464`) [default: off].
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Threads serving faults, shared by every VM [default: the CPUs].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// A recorded working set (from --record): prefetch it first, then the rest. One per
    /// --socket when given.
    #[arg(long)]
    prefetch: Vec<PathBuf>,
    /// Threads prefetching every VM's memory from the moment its handshake arrives, shared
    /// by every VM and below their faults in priority, reading ahead of each VM's latest
    /// fault first, then its working set (--prefetch, or learnt), then the rest in address
    /// order [default: the CPUs with --prefetch, else 1]. 0: faults alone bring memory in
    /// (a VM that never touches a page never gets it).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=1024))]
    prefetch_threads: Option<u32>,
    /// Write the blocks the VM faulted, in order, here when the VM goes away (with --once).
    #[arg(long, requires = "once")]
    record: Option<PathBuf>,
    /// Bytes served per fault (a snapshot in the store is served a frame a fault).
    #[arg(long, default_value = "1M", value_parser = size)]
    block: u64,
    /// Give up when no VM connects within this many seconds [default: wait] (with --once).
    #[arg(long, value_parser = secs, requires = "once")]
    accept_timeout_s: Option<f64>,
    /// Drop a connection that has not sent its whole handshake within this many seconds
    /// (and listen on for the real VM).
    #[arg(long, default_value = "5", value_parser = secs)]
    handshake_timeout_s: f64,
    /// What to do to a VM that sent its userfaultfd and then cannot be served (its vCPUs
    /// would wait for ever): every refusal and serving failure after that point.
    #[arg(long, value_enum, default_value = "kill")]
    on_failure: OnFailure,
    /// Once all of a VM's 4 KiB memory is in, collapse it to transparent huge pages in its
    /// process (process_madvise MADV_COLLAPSE through its pidfd), in the background, from a
    /// second later (the VM's first burst of work after the restore is left alone).
    #[arg(long, value_enum, default_value = "on")]
    regain_huge_pages: Switch,
    /// How log lines are written to standard error: text, or one JSON object a line (each
    /// VM's session start, end and failure as one structured event).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Switch {
    On,
    Off,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnFailure {
    /// SIGKILL the VM's process (through the pidfd taken when it connected), so it ends
    /// rather than hangs.
    Kill,
    /// Leave it (it hangs on the memory that never arrives).
    Leave,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line.
    Json,
}

/// Sends the library's and this command's `tracing` events to standard error.
pub(crate) fn init_logs(format: LogFormat) {
    let b = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(false);
    let _ = match format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (1e-3..=1e9).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: a number of seconds from 0.001 to 1e9")),
    }
}

/// Runs `guestmem serve-uffd`: everything that can be refused is refused before a socket
/// appears; then one server serves every VM until SIGTERM or SIGINT, which drains it and
/// exits 0 (with `--once`, one VM, until it goes).
pub fn run(a: Args) -> Result<()> {
    init_logs(a.log_format);
    if a.socket.len() != a.mem_file.len() {
        bail!(
            "{} --socket and {} --mem-file given: each socket serves one memory file, in order",
            a.socket.len(),
            a.mem_file.len()
        );
    }
    if !a.prefetch.is_empty() && a.prefetch.len() != a.socket.len() {
        bail!(
            "{} --prefetch for {} --socket: give one working set per socket, or none",
            a.prefetch.len(),
            a.socket.len()
        );
    }
    if a.once && a.socket.len() != 1 {
        bail!(
            "--once serves one VM on one socket; {} given",
            a.socket.len()
        );
    }
    // Before any thread starts (an object store's client starts its runtime's), so that
    // every thread inherits the mask and only the waiter below takes the signals.
    let signals = block_drain_signals()?;
    let mut store = crate::store::Stores::new(
        a.cache_dir.as_deref(),
        a.cache_size,
        Duration::from_secs_f64(a.fetch_deadline),
    )?;
    let mems = a
        .mem_file
        .iter()
        .map(|p| match p.to_str().filter(|s| StoreUrl::is_store_url(s)) {
            Some(url) => store.open(url).with_context(|| format!("--mem-file {url}")),
            None => MemoryFile::open(p).with_context(|| format!("--mem-file {}", p.display())),
        })
        .collect::<Result<Vec<_>>>()?;
    let mut working_sets = a
        .prefetch
        .iter()
        .map(|p| WorkingSetFile::read(p).with_context(|| format!("--prefetch {}", p.display())))
        .collect::<Result<Vec<_>>>()?;
    if working_sets.is_empty() {
        // A guestmem snapshot pushed with its working set brings it along.
        working_sets = mems.iter().map(|m| m.recorded_working_set()).collect();
    }
    working_sets.resize(a.socket.len(), Vec::new());
    if let Some(path) = &a.record {
        WorkingSetFile::check_writable(path)
            .with_context(|| format!("--record {}", path.display()))?;
    }
    let cfg = server_config(&a);
    cfg.check()?;
    let mut taken = match &a.take_over {
        Some(control) => Some(
            serve::take_over(control, Duration::from_secs(30))
                .with_context(|| format!("--take-over {}", control.display()))?,
        ),
        None => None,
    };
    let mut sockets = Vec::new();
    for ((path, memory), working_set) in a.socket.iter().zip(mems).zip(working_sets) {
        let flag = || format!("--socket {}", path.display());
        let handed = match taken.as_mut() {
            Some(t) => t.listener(path).with_context(flag)?,
            None => None,
        };
        let listener = match handed {
            Some(l) => l,
            None => Listener::bind(path).with_context(flag)?,
        };
        tracing::info!("listening on {}", path.display());
        sockets.push(Socket {
            listener,
            memory,
            working_set,
        });
    }
    if let (Some(t), Some(control)) = (taken.as_mut(), &a.take_over) {
        // Only now are the VMs this server's: it serves every socket handed and every VM's
        // memory file (else the old server serves on). Before the state directory's lock,
        // which the old server holds until it exits.
        let mems: Vec<&MemoryFile> = sockets.iter().map(|s: &Socket| &s.memory).collect();
        // Up to 2 minutes for the old server to exit once it said `yours` (it may be
        // finishing a fetch from the store); then the VMs it handed are ended.
        t.confirm(&mems, a.state_dir.as_deref(), Duration::from_secs(120))
            .with_context(|| format!("--take-over {}", control.display()))?;
    }
    let mut server = Server::new(sockets, cfg).with_context(|| {
        a.state_dir
            .as_ref()
            .map_or(String::from("start the server"), |d| {
                format!("start the server (--state-dir {})", d.display())
            })
    })?;
    if let Some(t) = taken {
        tracing::info!(
            "took over {} VMs from process {} in {:.3} s",
            t.vms(),
            t.old_pid.map_or("?".into(), |p| p.to_string()),
            t.handed_secs
        );
        server.adopt(t)?;
    }
    let drainer = server.drainer();
    let status = server.status();
    let _control = match &a.control {
        Some(path) => {
            let l = Listener::bind_private(path)
                .with_context(|| format!("--control {}", path.display()))?;
            tracing::info!("control socket {}", path.display());
            Some(status.serve_control(l, drainer.clone())?)
        }
        None => None,
    };
    let _metrics = match a.metrics {
        Some(addr) => {
            let (m, bound) = status
                .serve_metrics(addr)
                .with_context(|| format!("--metrics {addr}"))?;
            tracing::info!("metrics on http://{bound}/metrics");
            Some(m)
        }
        None => None,
    };
    notify_ready(a.socket.len());
    std::thread::Builder::new()
        .name("guestmem-signals".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: `signals` is an initialised sigset; sigwait writes one int.
            if unsafe { libc::sigwait(&signals, &mut sig) } == 0 {
                tracing::info!("signal {sig}: draining");
            }
            drainer.drain();
        })?;
    let report = server.run()?;
    if let (Some(path), Some(last)) = (&a.record, &report.last) {
        WorkingSetFile::write(path, &last.working_set)
            .with_context(|| format!("--record {}", path.display()))?;
    }
    print_report(&report, a.once, a.json)
}

/// Tells systemd the server is ready (`Type=notify`), once every socket listens: one
/// datagram `READY=1` to `$NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace), as
/// `sd_notify(3)` describes. Nothing without the variable; a failure is printed, not fatal.
fn notify_ready(sockets: usize) {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(to) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let msg = format!("READY=1\nSTATUS=serving on {sockets} sockets\n");
    let sent = (|| {
        let s = UnixDatagram::unbound()?;
        let bytes = to.as_encoded_bytes();
        match bytes.strip_prefix(b"@") {
            Some(name) => s.send_to_addr(msg.as_bytes(), &SocketAddr::from_abstract_name(name)?),
            None => s.send_to(msg.as_bytes(), &to),
        }
    })();
    if let Err(e) = sent {
        tracing::warn!("could not notify systemd at {to:?}: {e}");
    }
}

/// The serving settings the flags give.
fn server_config(a: &Args) -> ServerConfig {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    ServerConfig {
        handler_threads: a.threads.map_or(cpus, |t| t as usize),
        prefetch_threads: a
            .prefetch_threads
            .map_or(if a.prefetch.is_empty() { 1 } else { cpus }, |t| t as usize),
        block_bytes: a.block,
        vms: if a.once {
            Vms::One {
                wait: a.accept_timeout_s.map(Duration::from_secs_f64),
            }
        } else {
            Vms::Every
        },
        max_vms: a.max_vms as usize,
        max_bytes: a.max_memory,
        on_failure: match a.on_failure {
            OnFailure::Kill => serve::OnFailure::Kill,
            OnFailure::Leave => serve::OnFailure::Leave,
        },
        handshake_timeout: Duration::from_secs_f64(a.handshake_timeout_s),
        state_dir: a.state_dir.clone(),
        learn_working_sets: a.learn_working_sets,
        regain_huge: a.regain_huge_pages == Switch::On,
        // Every line goes through `tracing` (see `init_logs`).
        log: ServeLog::default(),
    }
}

/// Blocks SIGTERM and SIGINT in this thread (and so in every thread it starts): they are
/// taken by `sigwait`, as a request to drain, not by the default action.
pub(crate) fn block_drain_signals() -> Result<libc::sigset_t> {
    // SAFETY: sigemptyset initialises the set; sigaddset and pthread_sigmask read it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        let r = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if r != 0 {
            bail!(
                "block SIGTERM and SIGINT: {}",
                std::io::Error::from_raw_os_error(r)
            );
        }
        Ok(set)
    }
}

/// Prints the report: with `--once`, what was done for the VM; else a line per socket.
fn print_report(report: &ServerReport, once: bool, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
        return Ok(());
    }
    if let (true, Some(last)) = (once, &report.last) {
        let e = &last.engine;
        println!(
            "served {:.3} s until {}; {} faults ({} brought a block in, {} waited on one \
             coming, {} came late), {} blocks prefetched, {} zero blocks, {} MiB copied, {} \
             removes; {} of {} blocks in",
            last.served_secs,
            last.end,
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
        return Ok(());
    }
    let st = &report.status;
    for k in &st.sockets {
        let e = &k.ended;
        println!(
            "socket {} ({}): {} VMs: {} graduated, {} closed their socket, {} exited, {} \
             handed off, {} failed; {} faults, {} MiB copied",
            k.socket,
            k.path.display(),
            k.sessions,
            e.graduated,
            e.peer_closed,
            e.peer_exited,
            e.handed_off,
            e.failed,
            k.faults,
            k.bytes_copied >> 20
        );
    }
    println!(
        "served {} VMs on {} fault threads and {} prefetch threads in {:.3} s; {} refused, {} \
         connections dropped",
        st.sockets.iter().map(|k| k.sessions).sum::<u64>(),
        st.pool_threads,
        st.prefetch_threads,
        st.uptime_secs,
        st.refused,
        st.dropped
    );
    Ok(())
}
