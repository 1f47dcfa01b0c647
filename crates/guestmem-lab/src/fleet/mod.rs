//! The fleet scenario: many VMs restored at once from one snapshot. A host that restores or
//! clones VMs all day runs one page server for all of them, or one per VM; this measures
//! both beside Firecracker's own example handler.
//!
//! `vms` stand-in VMs ([`guestmem_testkit::firecracker`], Firecracker's exact handshake) of `size` bytes
//! each are restored from one memory file (a distinct word at both ends of every page, in
//! the page cache before the rounds). Every VM connects, then one "vCPU" thread per VM
//! reads one word of every page, timing each read (each is a fault the server answers):
//!
//! - `fleet`: one guestmem page server ([`guestmem::serve::Server`]) on one socket, its
//!   pool of `pool` threads serving every VM;
//! - `fleet-learnt`: the same, prefetching for every VM the working set the server learnt
//!   from the VMs of a round before the measured ones (`--learn-working-sets`), on one
//!   prefetch thread below the faults;
//! - `once-servers`: a guestmem page server per VM (`serve-uffd --once`: its own socket and
//!   `pool` fault threads each);
//! - `fc-example`: a Firecracker `uffd_on_demand_handler` process per VM (one thread, one
//!   4 KiB `UFFDIO_COPY` per fault), when its binary is found.
//!
//! **What is measured**, per round: from the first connect to the last VM's last page
//! (`seconds`); each VM's own read time, and their spread (slowest over fastest, and Jain's
//! fairness index, 1 when every VM took the same time); the read latency each vCPU saw for
//! its faults (p50, p99, p999 over every VM's reads; the worst VM's p99); the servers' CPU
//! time (the process's CPU less the reader threads', or the handler processes'); and the
//! bytes the servers read with `read`/`pread` calls (`rchar`; Firecracker's handler maps
//! the file, so its reads do not show there). Every VM's words are checked against the file.

mod report;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use guestmem::serve::{Listener, MemoryFile, Server, ServerConfig, Socket, Vms};

use crate::error::LabError;
use crate::report::LabResult;
use crate::run::{available_cpus, ratio, summarise, thp_mode, Protocol, RunInfo, Sampled, Summary};
use guestmem_testkit::firecracker::{Standin, PAGE};
use guestmem_testkit::ChildGuard as Reaped;

/// The scenario's name.
pub const SCENARIO: &str = "fleet";
/// Default VMs restored at once.
pub const DEFAULT_VMS: usize = 50;
/// Default memory per VM.
pub const DEFAULT_SIZE: u64 = 64 << 20;

/// How to run the scenario (also its recorded settings).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FleetLabConfig {
    /// VMs restored at once.
    pub vms: usize,
    /// Memory per VM, bytes (a multiple of 1 MiB).
    pub size: u64,
    /// Fault-serving threads: the fleet's pool, or each once-server's handlers.
    pub pool: usize,
    /// Firecracker's `uffd_on_demand_handler` (the variant is left out without it).
    pub fc_handler: Option<PathBuf>,
    /// Which variants run (empty: all there are).
    #[serde(default)]
    pub only: Vec<String>,
    /// Where the memory file and sockets go (removed afterwards).
    pub work_dir: PathBuf,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// The command line to record.
    #[serde(skip)]
    pub command: String,
    /// THP mode (recorded).
    #[serde(default)]
    pub thp_mode: String,
}

impl Default for FleetLabConfig {
    fn default() -> Self {
        let fc = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/firecracker/uffd_on_demand_handler");
        FleetLabConfig {
            vms: DEFAULT_VMS,
            size: DEFAULT_SIZE,
            pool: available_cpus(),
            fc_handler: fc.exists().then_some(fc),
            only: Vec::new(),
            work_dir: std::env::temp_dir()
                .join(format!("guestmem-lab-fleet-{}", std::process::id())),
            protocol: Protocol {
                warmup: 1,
                rounds: 3,
                order: crate::run::Order::Rotate,
            },
            command: String::new(),
            thp_mode: String::new(),
        }
    }
}

/// One variant's samples and summaries.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FleetVariant {
    /// `fleet`, `once-servers` or `fc-example`.
    pub name: String,
    /// Seconds from the first connect to the last VM's last page.
    pub seconds: Summary,
    /// Each round's measurements, in run order.
    pub samples: Vec<Sampled<FleetSample>>,
}

/// One round of one variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FleetSample {
    /// From the first connect to the last VM's last page, seconds.
    pub seconds: f64,
    /// The slowest VM's read time over the fastest's.
    pub spread: f64,
    /// Jain's fairness index of the VMs' read times (1: all equal).
    pub jain: f64,
    /// Read latency over every VM's reads, microseconds.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// The worst VM's own 99th percentile.
    pub worst_vm_p99_us: f64,
    /// The servers' CPU time, seconds.
    pub server_cpu_secs: f64,
    /// Bytes the servers read through read calls (`None`: not measurable).
    pub server_read_bytes: Option<u64>,
    /// Faults the servers answered, all VMs (`None`: not counted by that server).
    #[serde(default)]
    pub faults: Option<u64>,
}

/// Every variant (the result's body).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FleetFindings {
    /// In the order they were listed.
    pub variants: Vec<FleetVariant>,
}

/// The scenario's whole result.
pub type FleetResult = LabResult<FleetLabConfig, FleetFindings>;

fn err(what: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> LabError {
    LabError::restore(what)
}

/// The word at byte `at` of the memory file (first and last word of each page; the rest 0).
fn pattern(at: u64) -> u64 {
    (at / PAGE as u64 + 7).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

/// The memory file; the XOR of the first word of every page.
fn memory_file(path: &Path, size: u64) -> Result<u64, LabError> {
    let mut buf = vec![0u8; size as usize];
    let mut digest = 0;
    for p in 0..size as usize / PAGE {
        let at = (p * PAGE) as u64;
        digest ^= pattern(at);
        buf[p * PAGE..p * PAGE + 8].copy_from_slice(&pattern(at).to_ne_bytes());
        buf[(p + 1) * PAGE - 8..(p + 1) * PAGE].copy_from_slice(&pattern(at).to_ne_bytes());
    }
    std::fs::write(path, &buf).map_err(err)?;
    Ok(digest)
}

/// CPU time of this process, seconds (`RUSAGE_SELF` or `RUSAGE_THREAD`).
fn cpu(who: libc::c_int) -> f64 {
    // SAFETY: an all-zero rusage is valid; getrusage writes one.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `r` is a live rusage.
    unsafe { libc::getrusage(who, &mut r) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(r.ru_utime) + t(r.ru_stime)
}

/// `rchar` of `/proc/PID/io` (`self` for this process).
fn rchar(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("rchar:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// utime + stime of a child, seconds (from `/proc/PID/stat`, clock ticks).
fn child_cpu(pid: u32) -> f64 {
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 1..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / hz)
        })
        .unwrap_or(0.0)
}

/// What one VM's reader saw.
struct Read {
    seconds: f64,
    cpu: f64,
    lat_ns: Vec<u64>,
    digest: u64,
}

/// Reads one word of every page of each VM on a thread per VM, all released together.
fn read_all(vms: &[Standin]) -> Vec<Read> {
    let gate = std::sync::Barrier::new(vms.len());
    std::thread::scope(|s| {
        let hs: Vec<_> = vms
            .iter()
            .map(|vm| {
                let gate = &gate;
                s.spawn(move || {
                    let pages = vm.size() / PAGE;
                    let mut lat_ns = Vec::with_capacity(pages);
                    let mut digest = 0;
                    gate.wait();
                    let t0 = Instant::now();
                    for p in 0..pages {
                        let t = Instant::now();
                        digest ^= vm.word(p * PAGE);
                        lat_ns.push(t.elapsed().as_nanos() as u64);
                    }
                    Read {
                        seconds: t0.elapsed().as_secs_f64(),
                        cpu: cpu(libc::RUSAGE_THREAD),
                        lat_ns,
                        digest,
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("reader")).collect()
    })
}

/// The `q` quantile of sorted `v`, microseconds.
fn quantile(v: &[u64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
    v[i] as f64 / 1000.0
}

/// One round's sample from the readers' results; `server` is (CPU seconds, read bytes).
fn sample(
    seconds: f64,
    reads: &[Read],
    server: (f64, Option<u64>),
    digest: u64,
    name: &str,
) -> Result<FleetSample, LabError> {
    if let Some(bad) = reads.iter().position(|r| r.digest != digest) {
        return Err(err(format!(
            "{name}: VM {bad} read words that do not match the memory file"
        )));
    }
    let secs: Vec<f64> = reads.iter().map(|r| r.seconds).collect();
    let (min, max) = secs
        .iter()
        .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
    let sum: f64 = secs.iter().sum();
    let sq: f64 = secs.iter().map(|x| x * x).sum();
    let mut all: Vec<u64> = reads
        .iter()
        .flat_map(|r| r.lat_ns.iter().copied())
        .collect();
    all.sort_unstable();
    let worst = reads
        .iter()
        .map(|r| {
            let mut v = r.lat_ns.clone();
            v.sort_unstable();
            quantile(&v, 0.99)
        })
        .fold(0.0, f64::max);
    Ok(FleetSample {
        seconds,
        spread: ratio(max, min),
        jain: ratio(sum * sum, secs.len() as f64 * sq),
        p50_us: quantile(&all, 0.5),
        p99_us: quantile(&all, 0.99),
        p999_us: quantile(&all, 0.999),
        worst_vm_p99_us: worst,
        server_cpu_secs: server.0,
        server_read_bytes: server.1,
        faults: None,
    })
}

/// Fresh stand-in VMs.
fn vms(cfg: &FleetLabConfig) -> Result<Vec<Standin>, LabError> {
    (0..cfg.vms)
        .map(|_| Standin::new(&[cfg.size as usize], false).map_err(err))
        .collect()
}

/// Waits until `path` exists (a server's socket), at most 20 s.
fn wait_for(path: &Path) -> Result<(), LabError> {
    let t = Instant::now();
    while !path.exists() {
        if t.elapsed() > Duration::from_secs(20) {
            return Err(err(format!("no socket at {}", path.display())));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

fn server_config(cfg: &FleetLabConfig, learn: bool) -> ServerConfig {
    ServerConfig {
        handler_threads: cfg.pool,
        // Faults alone, but for a learnt working set, replayed on one thread.
        prefetch_threads: usize::from(learn),
        learn_working_sets: learn,
        // The stand-in VMs are threads of this one process: a collapse in one VM's memory
        // takes the address space's lock that every other VM's faults need here, where
        // separate VM processes would not share it (it cost the fleet ~0.3 s of 0.8 here).
        regain_huge: false,
        ..ServerConfig::default()
    }
}

/// A server of `mem` on `socket`, set by `cfg`.
fn server(socket: &Path, mem: &Path, cfg: ServerConfig) -> Result<Server, LabError> {
    let listener = Listener::bind(socket).map_err(err)?;
    Server::new(
        vec![Socket {
            listener,
            memory: MemoryFile::open(mem).map_err(err)?,
            working_set: Vec::new(),
        }],
        cfg,
    )
    .map_err(err)
}

/// One server serves every VM (learning and replaying working sets when `learn`).
fn fleet_round(
    cfg: &FleetLabConfig,
    mem: &Path,
    digest: u64,
    learn: bool,
) -> Result<FleetSample, LabError> {
    let socket = cfg.work_dir.join("fleet.sock");
    let fleet = server(&socket, mem, server_config(cfg, learn))?;
    let drainer = fleet.drainer();
    let mut vms = vms(cfg)?;
    let (cpu0, io0) = (cpu(libc::RUSAGE_SELF), rchar("self"));
    let sup = std::thread::Builder::new()
        .name("fleet-supervisor".into())
        .spawn(move || fleet.run())
        .map_err(err)?;
    let t0 = Instant::now();
    for vm in &mut vms {
        vm.connect(&socket).map_err(err)?;
    }
    let reads = read_all(&vms);
    let seconds = t0.elapsed().as_secs_f64();
    let server_cpu = cpu(libc::RUSAGE_SELF) - cpu0 - reads.iter().map(|r| r.cpu).sum::<f64>();
    let io = rchar("self") - io0;
    for vm in &mut vms {
        vm.disconnect();
    }
    drainer.drain();
    let report = sup
        .join()
        .map_err(|_| err("the fleet panicked"))?
        .map_err(err)?;
    let name = if learn { "fleet-learnt" } else { "fleet" };
    let mut s = sample(
        seconds,
        &reads,
        (server_cpu.max(0.0), Some(io)),
        digest,
        name,
    )?;
    s.faults = Some(report.status.sockets.iter().map(|k| k.faults).sum());
    Ok(s)
}

/// A guestmem page server per VM.
fn once_round(cfg: &FleetLabConfig, mem: &Path, digest: u64) -> Result<FleetSample, LabError> {
    let mut vms = vms(cfg)?;
    let (cpu0, io0) = (cpu(libc::RUSAGE_SELF), rchar("self"));
    let mut servers = Vec::new();
    for i in 0..cfg.vms {
        let socket = cfg.work_dir.join(format!("once-{i}.sock"));
        let once = ServerConfig {
            vms: Vms::One { wait: None },
            ..server_config(cfg, false)
        };
        let s = server(&socket, mem, once)?;
        servers.push((socket, std::thread::spawn(move || s.run())));
    }
    let t0 = Instant::now();
    for (vm, (socket, _)) in vms.iter_mut().zip(&servers) {
        vm.connect(socket).map_err(err)?;
    }
    let reads = read_all(&vms);
    let seconds = t0.elapsed().as_secs_f64();
    let server_cpu = cpu(libc::RUSAGE_SELF) - cpu0 - reads.iter().map(|r| r.cpu).sum::<f64>();
    let io = rchar("self") - io0;
    for vm in &mut vms {
        vm.disconnect();
    }
    for (_, h) in servers {
        h.join()
            .map_err(|_| err("a page server panicked"))?
            .map_err(err)?;
    }
    sample(
        seconds,
        &reads,
        (server_cpu.max(0.0), Some(io)),
        digest,
        "once-servers",
    )
}

/// A Firecracker example handler process per VM.
fn fc_round(
    cfg: &FleetLabConfig,
    bin: &Path,
    mem: &Path,
    digest: u64,
) -> Result<FleetSample, LabError> {
    // Declared before the handlers so that, on every path, the handlers drop first (see
    // below).
    let mut vms = vms(cfg)?;
    let mut handlers = Vec::new();
    for i in 0..cfg.vms {
        let socket = cfg.work_dir.join(format!("fc-{i}.sock"));
        let _ = std::fs::remove_file(&socket);
        let child = Command::new(bin)
            .arg(&socket)
            .arg(mem)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(err)?;
        handlers.push((socket, Reaped::new(child)));
    }
    for (socket, _) in &handlers {
        wait_for(socket)?;
    }
    let t0 = Instant::now();
    for (vm, (socket, _)) in vms.iter_mut().zip(&handlers) {
        // The handler binds its socket before it listens: a connect in between is refused.
        let t = Instant::now();
        loop {
            match vm.connect(socket) {
                Ok(()) => break,
                Err(e)
                    if e.raw_os_error() == Some(libc::ECONNREFUSED)
                        && t.elapsed() < Duration::from_secs(10) =>
                {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(e) => return Err(err(e)),
            }
        }
    }
    let reads = read_all(&vms);
    let seconds = t0.elapsed().as_secs_f64();
    let server_cpu: f64 = handlers.iter().map(|(_, h)| child_cpu(h.id())).sum();
    // The handler maps the memory file: its reads are page faults, not read calls.
    let s = sample(seconds, &reads, (server_cpu, None), digest, "fc-example");
    for (socket, _) in &handlers {
        let _ = std::fs::remove_file(socket);
    }
    // The handlers go first: one that sees its VM's socket close takes it for a new VM,
    // finds no descriptor, panics, and its panic hook SIGKILLs the peer (this process).
    drop(handlers);
    drop(vms);
    s
}

/// Runs the scenario; writes nothing but its scratch files (removed afterwards).
pub fn run_fleet(cfg: &FleetLabConfig) -> Result<FleetResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    if cfg.vms == 0 || cfg.pool == 0 || cfg.size == 0 || !cfg.size.is_multiple_of(1 << 20) {
        return Err(LabError::Config {
            scenario: SCENARIO,
            reason: "VMs and pool threads must be non-zero, the size a multiple of 1 MiB".into(),
        });
    }
    crate::run::in_work_dir(&cfg.work_dir, || run_in(cfg))
}

fn run_in(cfg: &FleetLabConfig) -> Result<FleetResult, LabError> {
    let run = RunInfo::collect(cfg.command.clone());
    let mem = cfg.work_dir.join("memory");
    let digest = memory_file(&mem, cfg.size)?;
    let mut names = vec!["fleet", "fleet-learnt", "once-servers"];
    if cfg.fc_handler.is_some() {
        names.push("fc-example");
    }
    names.retain(|n| cfg.only.is_empty() || cfg.only.iter().any(|o| o == n));
    if names.contains(&"fleet-learnt") {
        // The round the working set is learnt from (beside the memory file).
        fleet_round(cfg, &mem, digest, true)?;
    }
    let samples = cfg.protocol.run(names.len(), |i| match names[i] {
        "fleet" => fleet_round(cfg, &mem, digest, false),
        "fleet-learnt" => fleet_round(cfg, &mem, digest, true),
        "once-servers" => once_round(cfg, &mem, digest),
        _ => fc_round(cfg, cfg.fc_handler.as_deref().expect("given"), &mem, digest),
    })?;
    let body: Vec<FleetVariant> = names
        .iter()
        .zip(samples)
        .map(|(n, samples)| FleetVariant {
            name: n.to_string(),
            seconds: summarise(&samples, |s| s.seconds),
            samples,
        })
        .collect();
    Ok(LabResult {
        scenario: SCENARIO.into(),
        seeds: Vec::new(),
        run,
        settings: FleetLabConfig {
            thp_mode: thp_mode(),
            ..cfg.clone()
        },
        timed: "from the first VM's connect (servers already listening) to the last VM's \
                last page; each VM's handshake, then its reads on one thread"
            .into(),
        body: FleetFindings { variants: body },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_fairness_read_what_they_say() {
        let v: Vec<u64> = (1..=1000).map(|x| x * 1000).collect();
        assert_eq!(quantile(&v, 0.5), 500.0);
        assert_eq!(quantile(&v, 0.99), 990.0);
        assert_eq!(quantile(&v, 1.0), 1000.0);
        let read = |seconds: f64| Read {
            seconds,
            cpu: 0.0,
            lat_ns: vec![1000],
            digest: 7,
        };
        let s = sample(1.0, &[read(1.0), read(1.0)], (0.0, None), 7, "t").unwrap();
        assert_eq!((s.spread, s.jain), (1.0, 1.0));
        let s = sample(1.0, &[read(1.0), read(3.0)], (0.0, None), 7, "t").unwrap();
        assert_eq!(s.spread, 3.0);
        assert!((s.jain - 0.8).abs() < 1e-9, "{}", s.jain);
        assert!(sample(1.0, &[read(1.0)], (0.0, None), 8, "t").is_err());
    }
}
